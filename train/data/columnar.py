"""Parquet and Arrow (a .parquet file, an .arrow file, a datasets save_to_disk folder) read as
pyarrow record batches, only the columns asked for, each row held to MAX_RECORD_MB before it
becomes Python objects: a parquet row group over the bound is refused from the file's metadata
before anything is decompressed, or with SKIP_BAD_RECORDS read past as SkippedRows (counted by
the caller, never read). train/data/records.py reads every source through here and json_lines.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from train.data.json_lines import BadLine, record_bytes, row_groups_bounded, rows_bounded, suffix_of
from train.data.json_lines import converts as _converts
from train.data.json_lines import fail as _fail
from train.data.json_lines import out_of_range as _out_of_range
from train.data.json_lines import short as _short

ROWS_PER_BATCH = 1024


def _arrow_files(path: Path) -> list[Path]:
    """The .arrow files of a save_to_disk folder, in the order its state.json lists them."""
    try:
        state = json.loads((path / "state.json").read_text())
        names = [entry["filename"] for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError):
        names = sorted(p.name for p in path.glob("data-*.arrow")) or sorted(
            p.name for p in path.glob("*.arrow")
        )
    counts = Counter(map(str, names))
    twice = next((name for name, n in counts.items() if n > 1), None)
    if twice is not None:  # each of its records would train once per listing, without a word
        raise _fail(path, "", f"state.json lists {twice} {counts[twice]} times; list each data file once")
    for name in names:
        # Reads stay inside the folder: a listed "../x" or a link out is refused.
        file = path / str(name)
        if Path(str(name)).name != name or file.is_symlink() or not file.is_file():
            raise _fail(path, "", f"state.json lists {name}, which is not a file of the folder")
    return [path / name for name in names]


def _arrow_batches(file: Path, columns: list[str] | None):
    """Record batches of one .arrow file, memory-mapped: datasets writes the IPC stream format;
    the IPC file format is read too."""
    import pyarrow as pa

    source = pa.memory_map(str(file))
    try:
        reader = pa.ipc.open_stream(source)
        batches = iter(reader)
        schema = reader.schema
    except pa.ArrowInvalid:
        reader = pa.ipc.open_file(source)
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        schema = reader.schema
    _check_columns(file, schema.names, columns)
    for batch in batches:
        yield batch.select(columns) if columns else batch


def _check_columns(path: Path, names: list[str], columns: list[str] | None) -> None:
    for column in columns or ():
        if column not in names:
            raise _fail(
                path, "", f'has no column "{column}" (TEXT_FIELD names the text column); columns: '
                          f'{", ".join(names)}'
            )


def _columnar_files(path: Path) -> list[Path]:
    return _arrow_files(path) if path.is_dir() else [path]


class SkippedRows(BadLine):
    """Rows over MAX_RECORD_MB read past (SKIP_BAD_RECORDS), in their batches' place: how many, why."""

    def __init__(self, rows: int, why: str):
        super().__init__(why)
        self.rows = rows


def _parquet_batches(reader, batch_rows: int, columns: list[str] | None, over: dict):
    """The file's batches, a row group in `over` (row_groups_bounded's) as SkippedRows instead."""
    if not over:
        yield from reader.iter_batches(batch_size=batch_rows, columns=columns)
        return
    for k in range(reader.metadata.num_row_groups):
        if k not in over:
            yield from reader.iter_batches(batch_size=batch_rows, columns=columns, row_groups=[k])
            continue
        where, why = over[k]
        rows = reader.metadata.row_group(k).num_rows
        yield SkippedRows(rows, why if rows == 1 else f"{where} (one row group) {why}")


def _rows_within(file: Path, batch, row: int, limit: int, skip: bool):
    """The batch, or with skip its rows over the bound as SkippedRows between slices of the rest."""
    over, start = rows_bounded(file, batch, row, limit, skip), 0
    for i, why in over.items():
        if i > start:
            yield batch.slice(start, i - start)
        yield SkippedRows(1, why)
        start = i + 1
    if start < batch.num_rows or not over:
        yield batch.slice(start) if start else batch


def record_batches(path: Path, columns: list[str] | None = None, batch_rows: int = ROWS_PER_BATCH,
                   skip_long: bool = False):
    """pyarrow RecordBatches of a parquet file, an .arrow file or a save_to_disk folder, with
    only `columns` read where given (a missing one is a UsageError naming the file). A row over
    MAX_RECORD_MB is refused, or with skip_long (SKIP_BAD_RECORDS) given as SkippedRows in its
    place, never read into Python (a parquet row group over it: never decompressed)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    row, limit = 1, record_bytes()
    for file in _columnar_files(path):
        try:
            if suffix_of(file) == ".parquet":
                # pre_buffer off: on, pyarrow buffers ahead of the batches it hands out, and a 1 GB
                # file held ~600 MB of them (peak RSS 680 MB reading its column; off: 179 MB, the
                # same as for a 100 MB file, and faster).
                reader = pq.ParquetFile(file, pre_buffer=False)
                _check_columns(file, reader.schema_arrow.names, columns)
                over = row_groups_bounded(file, reader.metadata, columns, row, limit, skip_long)
                batches = _parquet_batches(reader, batch_rows, columns, over)
            else:
                batches = _arrow_batches(file, columns)
            for batch in batches:
                for part in (
                    [batch]
                    if isinstance(batch, SkippedRows)
                    else _rows_within(file, batch, row, limit, skip_long)
                ):
                    row += part.rows if isinstance(part, SkippedRows) else part.num_rows
                    yield part
        except (pa.ArrowException, OSError, ValueError) as err:
            what = "parquet" if suffix_of(file) == ".parquet" else "Arrow"
            raise _fail(file, "", f"not a readable {what} file ({_short(err)})") from None


def is_text_type(kind) -> bool:
    """A string column, or a dictionary-encoded one (pandas "category": each distinct text once)."""
    import pyarrow as pa

    kind = kind.value_type if pa.types.is_dictionary(kind) else kind
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or str(kind) == "string_view"


def as_python(path: Path, values, first_row: int = 1) -> list:
    """values.to_pylist() (an array or a batch whose first row is first_row); a string column
    holding bytes that are not UTF-8 (pyarrow does not check on read) is one line naming the row."""
    try:
        return values.to_pylist()
    except UnicodeDecodeError:
        row = next(i for i in range(len(values)) if not _converts(values.slice(i, 1)))
        raise _fail(
            path, f"row {first_row + row}", "holds a string that is not UTF-8; save the text as UTF-8"
        ) from None
    except (OverflowError, ValueError) as err:  # a date, time or duration outside Python's range
        raise _out_of_range(path, values, first_row, err) from None


def text_column(path: Path, batch, field: str, first_row: int = 1) -> list[str | None]:
    """One batch's TEXT_FIELD as Python strings (nulls stay None), read as a column."""
    column = batch.column(0) if batch.num_columns == 1 else batch.column(field)
    if not is_text_type(column.type):
        raise _fail(path, "", f'column "{field}" (TEXT_FIELD) holds {column.type}, not text')
    return as_python(path, column, first_row)
