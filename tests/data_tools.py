"""Data files for tests, made here: a datasets save_to_disk folder (without that package),
parquet files, JSONL."""

from __future__ import annotations

import json
from pathlib import Path


def write_arrow_folder(folder: Path, rows: list[dict], batch_rows: int = 1000) -> Path:
    """The folder `datasets.Dataset.save_to_disk` writes: data-00000-of-00001.arrow in the Arrow
    IPC stream format (batches of 1000 rows, as datasets writes them), dataset_info.json and
    state.json naming the data file."""
    import pyarrow as pa

    folder.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(rows)
    features = {name: {"dtype": "string", "_type": "Value"} for name in table.schema.names}
    schema = table.schema.with_metadata({"huggingface": json.dumps({"info": {"features": features}})})
    name = "data-00000-of-00001.arrow"
    with pa.OSFile(str(folder / name), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for batch in table.cast(schema).to_batches(max_chunksize=batch_rows):
            writer.write_batch(batch)
    (folder / "dataset_info.json").write_text(
        json.dumps({"citation": "", "description": "", "features": features})
    )
    state = {
        "_data_files": [{"filename": name}],
        "_fingerprint": "0123456789abcdef",
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": None,
    }
    (folder / "state.json").write_text(json.dumps(state, indent=2))
    return folder


def write_parquet(path: Path, rows: list[dict], row_group_rows: int = 1000) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_rows)
    return path


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
