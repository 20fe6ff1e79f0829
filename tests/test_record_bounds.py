"""What one record may cost, and data that Python cannot hold (issue 37): a 60 MB reasoning part
made 6.5 GB of tokenizer encodings (now its two ends are encoded, the same example); a small zstd
parquet holding one huge row is refused from its metadata before anything is decompressed, a
huge row among small ones before it becomes Python objects; SKIP_BAD_RECORDS=1 reads past a JSONL
line over MAX_RECORD_MB and counts it; dates and durations out of Python's range name the file,
row and column; an Arrow folder listing a file twice is refused. Files are kept small by
lowering MAX_RECORD_MB; each case is one line, exit code 2, within a bounded time."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from suite_control import CpuSpent
from test_bad_records import GOOD_SFT, refused, world  # noqa: F401 (world: a fixture)
from test_sft_data import make_tokenizer

from conftest import ROOT
from data_tools import write_arrow_folder, write_jsonl
from train.core.errors import UsageError
from train.data import json_lines, records, tokenize
from train.data.chat.encode import encode_conversations, encode_pairs, ensure_special_tokens
from train.data.chat.formats import load_conversations
from train.data.chat.templates import Rendering

WORDS = ["alpha", "beta", "gamma", "delta", "so", "then", "therefore", "we", "check", "the", "sum", "\n"]


@pytest.fixture(scope="module")
def tok():
    tokenizer = make_tokenizer()
    ensure_special_tokens(tokenizer)
    return tokenizer


def words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def thinking(chars_words: int, seed: int = 0) -> list[dict]:
    return [
        {"role": "system", "content": "Think first."},
        {"role": "user", "content": words(2000, seed)},
        {
            "role": "assistant",
            "content": words(3000, seed + 1),
            "reasoning_content": words(chars_words, seed + 2),
        },
    ]


@pytest.mark.parametrize("truncation", ["keep_end", "keep_start"])
def test_a_long_piece_encoded_by_its_ends_gives_the_same_example(tok, truncation, monkeypatch):
    conversations = [thinking(20_000, s) for s in range(3)] + [
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    ]
    r = Rendering(truncation=truncation)
    got = encode_conversations(conversations, tok, 64, r), encode_pairs(conversations, tok, 64, r)
    # the reference: every piece encoded whole, then cut (what the kit did before)
    monkeypatch.setattr(
        tokenize, "encode_texts_bounded", lambda t, pieces, _: tokenize.encode_texts(t, pieces)
    )
    assert got == (encode_conversations(conversations, tok, 64, r), encode_pairs(conversations, tok, 64, r))
    assert got[0][1] == 3  # three of them were cut


SCRIPT = """
import resource, sys, time
sys.path.insert(0, "tests")
from test_sft_data import make_tokenizer
from train.data.chat.encode import encode_conversations, ensure_special_tokens
tok = make_tokenizer()
ensure_special_tokens(tok)
part = ("so then we check the sum of it " * 2_000_000)[: 60 << 20]
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
began = time.process_time()  # CPU seconds: the wall stretches on busy cores
turns = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": part}]
(example,), cut = encode_conversations([turns], tok, 256)
grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(len(example["input_ids"]), cut, grew // 1024, round(time.process_time() - began, 2))
"""


def test_a_60_mb_reasoning_part_costs_megabytes_not_gigabytes():
    """Before: 6.5 GB of encodings then SIGABRT (and minutes); now its ends: a few MB, a CPU second."""
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    n, cut, grew_mb, seconds = out.stdout.split()
    assert (int(n), int(cut)) == (256, 1)
    assert int(grew_mb) < 400 and float(seconds) < 20, out.stdout  # the part's own copies, not 100x it


def zstd_row(path, mb: float, small: int = 0):
    """A zstd parquet of one row of `mb` MB ("a" repeated: a few kB on disk), small rows around it."""
    rows = ["short"] * small + ["a" * int(mb * (1 << 20))] + ["short"] * small
    pq.write_table(pa.table({"text": rows, "other": list(range(len(rows)))}), path, compression="zstd")
    return path


def test_a_small_zstd_parquet_of_one_huge_row_is_refused_from_its_metadata(world, capsys):  # noqa: F811
    data = zstd_row(world["dir"] / "one.parquet", 6)
    assert data.stat().st_size < 50_000
    pool = pa.default_memory_pool()
    before = pool.bytes_allocated()
    with CpuSpent() as cpu, json_lines.record_limit(1):
        for read in (records.iter_texts, lambda p: records.iter_records(p)):
            with pytest.raises(UsageError, match=re.escape(f"{data} row 1 is 6.0 MB decompressed, over "
                                                           f"MAX_RECORD_MB=1")):
                list(read(data))
    assert pool.bytes_allocated() - before < 1 << 20 and cpu.spent < 5  # CPU seconds
    refused(world, "pretrain", data, f"{data} row 1 is 6.0 MB decompressed, over MAX_RECORD_MB=1",
            extra=["--max_record_mb", "1"], here=capsys)


def test_a_huge_row_among_small_ones_is_refused_before_python_holds_it(world, tmp_path, tok):  # noqa: F811
    data = zstd_row(tmp_path / "mixed.parquet", 3, small=40)
    with json_lines.record_limit(1):
        with pytest.raises(UsageError, match=re.escape(f"{data} row 41 is 3.0 MB decompressed, over "
                                                       f"MAX_RECORD_MB=1")):
            list(records.iter_texts(data))
    assert len([p for p in records.iter_texts(data) if p]) == 81  # the default bound (64 MB) reads it


def test_skip_bad_records_reads_past_a_line_over_max_record_mb(tmp_path):
    rows = [json.dumps(r) for r in GOOD_SFT]
    huge = json.dumps({"prompt": "x", "response": "y" * (3 << 20)})
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join([rows[0], huge, *rows[1:], huge]) + "\n")
    with json_lines.record_limit(1):
        conversations, _, skipped = load_conversations(data, skip_bad_records=True)
        assert (len(conversations), skipped) == (4, 2)
        with pytest.raises(UsageError, match=re.escape(f"{data} line 2: is longer than 1 MB (decompressed)")):
            load_conversations(data)
    with pytest.raises(UsageError, match="line 2 is longer than 1 MB"):  # pretraining: stops, as before
        with json_lines.record_limit(1):
            list(json_lines.jsonl_blocks(data))


def test_skip_bad_records_with_a_huge_line_trains_in_a_real_run(world, base_model, capsys):  # noqa: F811
    rows = [json.dumps(r) for r in GOOD_SFT * 3]
    data = world["dir"] / "d.jsonl"
    data.write_text(
        "\n".join(
            [*rows[:5], json.dumps({"messages": [{"role": "user", "content": "z" * (3 << 20)}]}), *rows[5:]]
        )
        + "\n"
    )
    from test_bad_records import train_here

    flags = [*world["flags"], "--data_path", str(data), "--model_path", str(base_model), "--batch_size", "2",
             "--max_record_mb", "1", "--skip_bad_records", "1", "--run_name", "skip"]  # fmt: skip
    result = train_here(capsys, "sft", *flags)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (f"skipped 1 bad record(s) (SKIP_BAD_RECORDS=1); the rest train; the first: {data} line 6: is "
            f"longer than 1 MB") in result.stdout


@pytest.mark.parametrize("column, expect", [
    (pa.array([1, 2, 2**62], pa.timestamp("us")), 'row 3 column "when": holds a timestamp[us] value outside '
     "Python's range (date value out of range)"),
    (pa.array([1, 2, 2**31 - 1], pa.int32()).cast(pa.date32()), 'row 3 column "when": holds a date32[day] '
                                                                'value '
     "outside Python's range (days=2147483647"),
], ids=["timestamp", "date"])  # fmt: skip
def test_dates_out_of_python_range_name_the_file_and_column(world, column, expect, capsys):  # noqa: F811
    table = pa.table({"prompt": ["a", "b", "c"], "response": ["x", "y", "z"], "when": column})
    data = world["dir"] / "dates.parquet"
    pq.write_table(table, data)
    with pytest.raises(UsageError, match=re.escape(f"DATA_PATH: {data} {expect}")):
        load_conversations(data)
    # then holding the dates:
    arrow = write_arrow_folder(world["dir"] / "arrow", [{"prompt": "a", "response": "x"}])
    with (
        pa.OSFile(str(arrow / "data-00000-of-00001.arrow"), "wb") as sink,
        pa.ipc.new_stream(sink, table.schema) as w,
    ):
        w.write_table(table)
    with pytest.raises(UsageError, match=re.escape(f"DATA_PATH: {arrow} {expect}")):
        load_conversations(arrow)


def test_an_arrow_folder_listing_a_file_three_times_is_refused(world, capsys):  # noqa: F811
    folder = write_arrow_folder(world["dir"] / "arrow", [{"text": f"document {i} " * 20} for i in range(50)])
    state = json.loads((folder / "state.json").read_text())
    state["_data_files"] *= 3
    (folder / "state.json").write_text(json.dumps(state))
    expect = f"{folder}: state.json lists data-00000-of-00001.arrow 3 times; list each data file once"
    with pytest.raises(UsageError, match=re.escape(expect)):
        list(records.iter_texts(folder))
    refused(world, "pretrain", folder, expect, here=capsys)
    write_jsonl(world["dir"] / "unused.jsonl", [])  # the folder alone was the data
