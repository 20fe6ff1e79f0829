"""Issue 37's last cases: pretraining on a CSV says once, in a decision line, that its commas and
quotes are read as text; under SKIP_BAD_RECORDS=1 a parquet row group (or a row) over
MAX_RECORD_MB is read past and counted, as a JSONL line is, and stops the run in one line without
it; a legal but large LORA_R whose adapters cannot fit is refused by the fit check in one line with
its figures (a fake small device: the machine has no GPU)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_bad_records import GOOD_SFT, refused, train_here, world  # noqa: F401 (world: a fixture)

from conftest import run_cli
from train.core.errors import UsageError
from train.data import json_lines, records
from train.data.chat.formats import load_conversations
from train.data.pretraining import note_plain_text
from train.models import estimate

BOUND = "0.0625"  # MAX_RECORD_MB takes fractions: 64 KiB keeps the files tiny


def big(letter: str) -> dict:
    """A 100 kB record; each its own letter, so that parquet's dictionary does not store them once."""
    return {
        "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": letter * 100_000}]
    }


def grouped_parquet(path, groups: list[list[dict]]):
    """A zstd parquet with one row group per list (a few kB on disk however long the rows)."""
    table = pa.Table.from_pylist([{"messages": GOOD_SFT[0]["messages"]}])
    with pq.ParquetWriter(path, table.schema, compression="zstd") as writer:
        for rows in groups:
            writer.write_table(pa.Table.from_pylist(rows, schema=table.schema))
    return path


def test_a_csv_is_said_once_to_be_read_as_plain_text(world, capsys):  # noqa: F811
    data = world["dir"] / "rows.csv"
    data.write_text("id,text\n" + "".join(f'{i},"the quick, brown fox {i}"\n' for i in range(400)))
    flags = [
        *world["flags"],
        *world["pretrain"],
        "--data_path",
        str(data),
        "--batch_size",
        "2",
        "--run_name",
        "csv",
    ]
    result = train_here(capsys, "pretrain", *flags)
    assert result.returncode == 0, result.stderr[-2000:]
    said = [line for line in result.stdout.splitlines() if "data_path_format" in line]
    assert (
        len(said) == 1 and "plain text (.csv)" in said[0] and "commas, quotes and header line" in said[0]
    ), said
    decisions = json.loads((world["runs"] / "csv" / "config.json").read_text())["decisions"]
    assert [d["value"] for d in decisions if d["setting"] == "data_path_format"] == ["plain text (.csv)"]
    decided = []  # a .txt, .md or JSONL source: nothing said
    for name in ("a.txt", "b.md", "c.jsonl"):
        (world["dir"] / name).write_text("x\n")
    note_plain_text([world["dir"] / n for n in ("a.txt", "b.md", "c.jsonl")], "DATA_PATH", "text",
                    lambda *a: decided.append(a))  # fmt: skip
    assert decided == []


def test_skip_bad_records_reads_past_a_parquet_row_group_over_max_record_mb(tmp_path):
    data = grouped_parquet(
        tmp_path / "g.parquet", [GOOD_SFT[:2], [big("a"), big("b")], GOOD_SFT[2:], [big("c")]]
    )
    assert data.stat().st_size < 20_000
    with json_lines.record_limit(float(BOUND)):
        conversations, _, skipped = load_conversations(data, skip_bad_records=True)
        assert (len(conversations), skipped) == (4, 3)
        with pytest.raises(UsageError, match=f"{data} row 3: rows 3-4 \\(one row group\\) is 0.1 MB a row on "
                                             f"average"):
            load_conversations(data)
        # one huge row among small ones in a group: that row alone is read past
        mixed = grouped_parquet(tmp_path / "m.parquet", [[*GOOD_SFT[:2], big("a"), *GOOD_SFT[2:]]])
        conversations, _, skipped = load_conversations(mixed, skip_bad_records=True)
        assert (len(conversations), skipped) == (4, 1)
        with pytest.raises(UsageError, match=f"{mixed} row 3: is 0.1 MB decompressed, over "
                                             f"MAX_RECORD_MB={BOUND}"):
            load_conversations(mixed)
        # pretraining: stops, as before
        with pytest.raises(UsageError, match="rows 3-4 is 0.1 MB a row on average"):
            list(records.iter_records(data))


def test_skip_bad_records_with_a_huge_parquet_row_group_trains_in_a_real_run(
    world, base_model, capsys  # noqa: F811
):
    data = grouped_parquet(world["dir"] / "g.parquet", [GOOD_SFT * 2, [big("a"), big("b")], GOOD_SFT])
    refused(world, "sft", data, f"{data} row 9: rows 9-10 (one row group)", "SKIP_BAD_RECORDS=1 skips such "
                                                                            "records",
            extra=["--model_path", str(base_model), "--max_record_mb", BOUND], here=capsys)
    flags = [*world["flags"], "--model_path", str(base_model), "--batch_size", "2", "--max_record_mb", BOUND]
    result = train_here(
        capsys, "sft", *flags, "--data_path", str(data), "--skip_bad_records", "1", "--run_name", "skip"
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert (f"skipped 2 bad record(s) (SKIP_BAD_RECORDS=1); the rest train; the first: {data} row 9: rows "
            f"9-10 "
            "(one row group) is 0.1 MB a row on average decompressed") in result.stdout, result.stdout[-3000:]


def fake_device(monkeypatch, mib: int):
    """A device of `mib` MiB (the machine has no GPU): what the fit check measures against."""
    monkeypatch.setattr(estimate, "memory_capacity", lambda device, cap: (mib << 20, f"a fake {mib} MiB "
                                                                                     f"device"))


def test_a_large_legal_lora_r_that_cannot_fit_is_refused_by_the_fit_check(
    world, base_model, capsys, monkeypatch  # noqa: F811
):
    data = world["dir"] / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in GOOD_SFT))
    flags = [*world["flags"], "--model_path", str(base_model), "--data_path", str(data), "--batch_size", "1"]
    # the tiny GPT-2 (width 64): one sequence with LORA_R=4 needs ~2.0 MiB, 64 ~3.4
    fake_device(monkeypatch, 3)
    assert run_cli("sft", *flags, "--lora_r", "64", "--run_name", "big") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(
        "error: LORA_R=64: the adapters (0.13M parameters: r x (in + out) on each of 8 "
        "layers) with their gradients and adamw state, beside the 0.13M frozen parameters of MODEL_PATH="
    ), err
    assert (
        "need at least 3.4 MiB (one sequence of 64 tokens); a fake 3 MiB device has 3.0 MiB; lower LORA_R"
        in err
    )
    assert not (world["runs"] / "big").exists()
    assert run_cli("sft", *flags, "--lora_r", "4", "--run_name", "small", "--dry_run", "1") == 0
    assert "cannot fit" not in capsys.readouterr().err
    # above every rank: said so first
    assert run_cli("sft", *flags, "--lora_r", "100000", "--run_name", "rank") == 2
    assert "LORA_R=100000: above the rank of every adapted layer" in capsys.readouterr().err
