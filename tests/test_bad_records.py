"""Records that cost without bound or do not decode, made for real and run through
`python -m train`: one line naming the file and the line or row, exit code 2, no traceback,
quickly, in bounded memory, and no run folder touched."""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest
from suite_control import CpuSpent
from test_bad_input import snapshot

from conftest import ROOT, launcher_env, run_cli, train_python
from train.core.errors import UsageError
from train.data import json_lines, records, tokenize
from train.data.chat.formats import load_conversations

GOOD = [{"text": f"line {i} of a small document"} for i in range(5)]
GOOD_SFT = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
            for i in range(4)]


@pytest.fixture
def world(tmp_path, tiny_config, cache_dir):
    runs = tmp_path / "runs"
    (runs / "keep").mkdir(parents=True)
    (runs / "keep" / "summary.json").write_text('{"mode": "pretrain"}')
    flags = [
        "--cache_dir",
        str(cache_dir),
        "--output_dir",
        str(runs),
        "--max_length",
        "64",
        "--max_steps",
        "1",
    ]
    pretrain = ["--model_config", str(tiny_config), "--vocab_size", "512"]
    return {"runs": runs, "flags": flags, "pretrain": pretrain, "dir": tmp_path}


def train(mode: str, *argv: str, timeout: int = 120, rss_file=None) -> subprocess.CompletedProcess:
    """`python -m train MODE ...` in a process of its own (a fork of the tests' warm server); with
    rss_file, a fresh interpreter that writes its own peak RSS there as it exits."""
    env = launcher_env({})
    command = [train_python(), "-m", "train"]
    if rss_file:
        code = (f"import atexit, resource; atexit.register(lambda: open({str(rss_file)!r}, 'w').write("
                "str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)))\n"
                "import runpy, sys; sys.argv[0] = 'train'; runpy.run_module('train', run_name='__main__')")
        command = [sys.executable, "-c", code]
    return subprocess.run(
        [*command, mode, *argv], env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def train_here(capsys, mode: str, *argv: str) -> subprocess.CompletedProcess:
    """The same entry point in this process (torch imported once: seconds less per case)."""
    capsys.readouterr()
    code = run_cli(mode, *argv)
    out = capsys.readouterr()
    return subprocess.CompletedProcess([mode, *argv], code, out.out, out.err)


def refused(world, mode: str, data, *expect: str, extra=(), here=None, **kw) -> subprocess.CompletedProcess:
    """Refused in one line; in a fresh `python -m train` process, or in this one given capsys."""
    before = snapshot(world["runs"])
    flags = [
        *world["flags"],
        *(world["pretrain"] if mode == "pretrain" else ()),
        "--data_path",
        str(data),
        *extra,
    ]
    result = train_here(here, mode, *flags) if here else train(mode, *flags, **kw)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-2000:]
    assert all(e in lines[0] for e in expect), lines[0]
    assert "Traceback" not in result.stderr + result.stdout
    assert snapshot(world["runs"]) == before and sorted(p.name for p in world["runs"].iterdir()) == ["keep"]
    return result


def jsonl(path, rows, bad: str):
    path.write_text("\n".join([json.dumps(rows[0]), bad, *map(json.dumps, rows[1:])]) + "\n")
    return path


def bad_utf8_parquet(path, column="text"):
    """A string column whose row 3 holds bytes that are not UTF-8: binary reinterpreted as string
    (no check), as a writer that does not validate leaves it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    raw = pa.array([b"fine text one", b"fine two", b"caf\xe9 \xff bad", b"four"], pa.binary())
    pq.write_table(pa.table({column: raw.view(pa.string())}), path)
    return path


DEEP = '{"text": "x", "deep": ' + "[" * 200_000 + "]" * 200_000 + "}"
HUGE_INT = '{"text": "x", "n": ' + "7" * 5000 + "}"
SURROGATE = '{"text": "lone \\ud800 half"}'


@pytest.mark.parametrize("bad, expect", [(DEEP, "nested too deep"), (HUGE_INT, "number too long"),
                                         (SURROGATE, "lone surrogate")], ids=["deep", "digits", "surrogate"])
def test_a_costly_or_undecodable_json_line_is_one_line(world, bad, expect, capsys):
    data = jsonl(world["dir"] / "d.jsonl", GOOD, bad)
    refused(world, "pretrain", data, f"{data} line 2", expect, here=capsys)


def test_a_lone_surrogate_with_a_given_tokenizer(world, base_model, capsys):
    data = jsonl(world["dir"] / "d.jsonl", GOOD, SURROGATE)
    refused(
        world,
        "pretrain",
        data,
        f"{data} line 2",
        "lone surrogate",
        extra=("--tokenizer_path", str(base_model)),
        here=capsys,
    )


def test_parquet_string_that_is_not_utf8_names_the_row(world):
    data = bad_utf8_parquet(world["dir"] / "d.parquet")
    refused(world, "pretrain", data, f"{data} row 3", "not UTF-8")
    sft = bad_utf8_parquet(world["dir"] / "s.parquet", "prompt")
    with pytest.raises(UsageError, match=re.escape(f"{sft} row 3: holds a string that is not UTF-8")):
        load_conversations(sft)


def test_a_category_column_is_text(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    # What pandas' "category" becomes in parquet: a dictionary-encoded string column.
    column = pa.array(["alpha beta", "gamma", "alpha beta", None]).dictionary_encode()
    pq.write_table(pa.table({"text": column}), tmp_path / "c.parquet")
    assert pa.types.is_dictionary(pq.read_schema(tmp_path / "c.parquet").field("text").type)
    want = ["alpha beta", "gamma", "alpha beta"]
    assert [p for p in records.iter_texts(tmp_path / "c.parquet") if p] == want
    units = [u for u, _ in tokenize.file_units(tmp_path / "c.parquet", "text")]
    assert [p for u in units for p in tokenize.unit_pieces(u) if p] == want


def bomb(path, gigabytes: float = 3.0):
    """A .jsonl.gz of a few MB holding one line of `gigabytes`: gzip members of 16 MB of "a" each
    (16 kB compressed), one after another, which gzip readers read as one stream."""
    member = gzip.compress(b"a" * (16 << 20), compresslevel=9)
    with open(path, "wb") as out:
        out.write(gzip.compress(b'{"text": "'))
        for _ in range(int(gigabytes * 1024 / 16)):
            out.write(member)
    return path


def peak_rise_kb(run) -> int | None:
    """run() in this process, and how far its peak RSS rose above the RSS it started at (kB); None
    where the kernel cannot reset this process's peak (/proc/self/clear_refs "5", Linux 4.0+)."""
    def status_kb(field: str) -> int:
        return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)[1])

    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return None
    start = status_kb("VmRSS")
    run()
    return status_kb("VmHWM") - start


def test_a_decompression_bomb_stops_quickly_in_bounded_memory(world, capsys):
    data = bomb(world["dir"] / "bomb.jsonl.gz")
    assert data.stat().st_size < 5 << 20
    # a bad line first: the kit's imports made, in this process, before the peak is measured
    refused(world, "pretrain", jsonl(world["dir"] / "warm.jsonl", GOOD, "{broken"), "line 2", here=capsys)
    with CpuSpent() as cpu:
        rise = peak_rise_kb(
            lambda: refused(world, "pretrain", data, f"{data} line 1", "longer than 64 MB", here=capsys)
        )
        print("peak RSS rise", rise, "kB")
        # the run in this process: ~2 x 64 MB (the line so far, the block read), not 3 GB
        if rise is not None:
            assert rise < 300_000, rise
        # a fresh interpreter that writes its own peak: the interpreter and torch, plus at most ~2 x 64 MB
        else:
            rss = world["dir"] / "rss"
            refused(world, "pretrain", data, f"{data} line 1", "longer than 64 MB", rss_file=rss)
            assert int(rss.read_text()) < 1_200_000
    assert cpu.spent < 60  # CPU seconds (its children's too): inflating 3 GB would take minutes
    # in this process under MAX_RECORD_MB=4 (the same reader; a sixteenth of the bytes to inflate)
    tracemalloc.start()
    with json_lines.record_limit(4), pytest.raises(UsageError, match="line 1 is longer than 4 MB"):
        for _ in json_lines.jsonl_blocks(data):
            pass
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 3 * (4 << 20)  # the line so far and its last block, not 3 GB
    with json_lines.record_limit(4), pytest.raises(UsageError, match="line 1: is longer than 4 MB"):
        load_conversations(data)  # SFT: a bad record (SKIP_BAD_RECORDS)


def test_a_bad_record_before_the_format_is_known_stops_the_read_there(tmp_path):
    from train.data.chat.formats import detect_format, first_format
    from train.data.chat.turns import BadRecord

    def stream():
        yield "d.jsonl.gz line 1", BadRecord("is longer than 4 MB (decompressed)")
        pytest.fail("read past the bad record: the rest of a 3 GB line decompressed for nothing")

    with pytest.raises(UsageError, match=re.escape("d.jsonl.gz line 1: is longer than 4 MB (decompressed) "
                                                   "(SKIP_BAD_RECORDS=1 skips")):  # fmt: skip
        first_format(stream(), detect_format, skip_bad_records=False)
    # the SFT run's first read (the tokenizer's language note) stops there too
    from types import SimpleNamespace

    from train.data.sft import first_texts

    data = jsonl(tmp_path / "d.jsonl", GOOD_SFT, "{broken")  # line 2 bad, line 1 good: a format first
    cut = tmp_path / "cut.jsonl"
    cut.write_text("\n".join(data.read_text().splitlines()[1:]) + "\n")  # the bad line first
    with pytest.raises(UsageError, match=re.escape(f"{cut} line 1: ")):
        first_texts(SimpleNamespace(data_path=str(cut), text_field="text", skip_bad_records=False))
    assert list(first_texts(SimpleNamespace(data_path=str(cut), text_field="text", skip_bad_records=True)))
    # SKIP_BAD_RECORDS=1: read on to the first good record; the rest stays in the stream
    records = iter([("line 1", BadRecord("x")), ("line 2", {"text": "hi"}), ("line 3", {"text": "after"})])
    fmt, head = first_format(records, detect_format, skip_bad_records=True)
    assert (fmt, [place for place, _ in head], next(records)[0]) == (
        detect_format({"text": "hi"}),
        ["line 1", "line 2"],
        "line 3",
    )


def test_a_symlink_loop_under_a_recursive_glob_ends(world):
    folder = world["dir"] / "loop" / "a"
    folder.mkdir(parents=True)
    for name in ("up", "top", "again"):  # each a way back: glob.glob's walk doubled with each
        os.symlink("..", folder / name)
    jsonl(folder / "bad.jsonl", GOOD, "{broken")
    refused(world, "pretrain", f"{world['dir']}/loop/**", "bad.jsonl line 2", timeout=60)
    assert records.source_files(f"{world['dir']}/loop/**") == [folder / "bad.jsonl"]


def test_a_fifo_in_a_folder_is_skipped_never_opened(world):
    folder = world["dir"] / "withfifo"
    folder.mkdir()
    os.mkfifo(folder / "x.txt")  # opening it would wait for a writer forever
    with pytest.raises(UsageError, match="holds no"):
        records.source_files(str(folder))
    with pytest.raises(UsageError, match="x.txt is not a regular file"):
        records.source_files(str(folder / "x.txt"))
    jsonl(folder / "bad.jsonl", GOOD, "{broken")
    result = refused(world, "pretrain", folder, "bad.jsonl line 2", timeout=60)  # read past the FIFO
    assert "skipped" in result.stdout and "x.txt: a FIFO" in result.stdout
    assert records.source_files(str(folder)) == records.source_files(f"{folder}/*") == [folder / "bad.jsonl"]


def test_a_glob_skips_a_stray_meta_json_as_the_folder_does(tmp_path):
    (tmp_path / "meta.json").write_text('{"rows": 3}')
    jsonl(tmp_path / "a.jsonl", GOOD, json.dumps(GOOD[0]))
    assert (
        records.source_files(f"{tmp_path}/*") == records.source_files(str(tmp_path)) == [tmp_path / "a.jsonl"]
    )
    assert records.source_files(f"{tmp_path}/*.json") == [tmp_path / "meta.json"]  # named: read


ROLE_LIST = {"messages": [{"role": ["user"], "content": "q"}, {"role": "assistant", "content": "a"}]}


def test_a_role_that_is_a_list_is_a_bad_record_skipped_with_the_knob(world, base_model, capsys):
    data = jsonl(world["dir"] / "d.jsonl", GOOD_SFT, json.dumps(ROLE_LIST))
    sft = ["--model_path", str(base_model), "--batch_size", "2"]
    refused(
        world,
        "sft",
        data,
        f"{data} line 2",
        "turn 1 has role ['user']",
        "SKIP_BAD_RECORDS",
        extra=sft,
        here=capsys,
    )
    result = train_here(
        capsys,
        "sft",
        *world["flags"],
        "--data_path",
        str(data),
        *sft,
        "--skip_bad_records",
        "1",
        "--run_name",
        "skip",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads((world["runs"] / "skip" / "summary.json").read_text())["n_skipped"] == 1


TOOL_CALL = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
    "name": "f", "arguments": "[1, 2]"}}]}
BAD_SFT = {
    "role dict": {"messages": [{"role": {"r": 1}, "content": "q"}, {"role": "assistant", "content": "a"}]},
    "observation first": {
        "conversations": [
            {"from": "human", "value": "q"},
            {"from": "observation", "value": "42"},
            {"from": "gpt", "value": "a"},
        ]
    },
    "arguments a list": {
        "messages": [
            {"role": "user", "content": "q"},
            TOOL_CALL,
            {"role": "tool", "content": "3"},
            {"role": "assistant", "content": "a"},
        ]
    },
}
EXPECT = {"role dict": "turn 1 has role {'r': 1}", "observation first": "turn 2 is a tool result "
                                                                        "(observation) before any call",
          "arguments a list": "turn 2 tool_calls arguments are a list, expected an object"}


@pytest.mark.parametrize("label", list(BAD_SFT))
def test_bad_tool_and_role_records_are_refused_or_counted(tmp_path, label):
    good = GOOD_SFT if label != "observation first" else [
        {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}] * 3
    data = jsonl(tmp_path / "d.jsonl", good, json.dumps(BAD_SFT[label]))
    with pytest.raises(UsageError, match=re.escape("d.jsonl line 2: " + EXPECT[label])):
        load_conversations(data)
    assert load_conversations(data, skip_bad_records=True)[2] == 1


@pytest.mark.parametrize("bad", [DEEP, HUGE_INT, SURROGATE], ids=["deep", "digits", "surrogate"])
def test_costly_sft_lines_are_bad_records_too(tmp_path, bad):
    data = jsonl(tmp_path / "d.jsonl", GOOD_SFT, bad.replace('"text": "x"', '"prompt": "p"'))
    with pytest.raises(UsageError, match=r"d.jsonl line 2: "):
        load_conversations(data)
    assert load_conversations(data, skip_bad_records=True)[2] == 1


def test_val_path_files_are_named_as_val_path(tmp_path):
    bad = jsonl(tmp_path / "val.jsonl", GOOD, "{broken")
    with pytest.raises(UsageError, match=re.escape(f"VAL_PATH: {bad} line 2: not valid JSON")):
        with records.reading("VAL_PATH"):
            list(records.iter_texts(bad))
    with pytest.raises(UsageError, match=r"^VAL_PATH: .*d\.jsonl line 2: turn 1 has role"):
        with records.reading("VAL_PATH"):
            load_conversations(jsonl(tmp_path / "d.jsonl", GOOD_SFT, json.dumps(ROLE_LIST)))


def test_bad_val_path_contents_are_named_as_val_path_by_a_real_run(world, base_model, capsys):
    """E7/E8 through `python -m train`: the data is fine, VAL_PATH's file is not."""
    good = jsonl(world["dir"] / "good.jsonl", GOOD * 8, json.dumps(GOOD[0]))
    val = jsonl(world["dir"] / "val.jsonl", GOOD, "{broken")
    refused(
        world,
        "pretrain",
        good,
        f"VAL_PATH: {val} line 2: not valid JSON",
        extra=["--val_path", str(val)],
        here=capsys,
    )
    good_sft = jsonl(world["dir"] / "good_sft.jsonl", GOOD_SFT, json.dumps(GOOD_SFT[0]))
    val_sft = jsonl(world["dir"] / "val_sft.jsonl", GOOD_SFT, json.dumps(ROLE_LIST))
    sft = ["--model_path", str(base_model), "--batch_size", "2", "--val_path", str(val_sft)]
    refused(world, "sft", good_sft, f"VAL_PATH: {val_sft} line 2: turn 1 has role", extra=sft, here=capsys)


def test_max_record_mb_sets_the_bound(world, capsys):
    """A 2 MB record: refused under MAX_RECORD_MB=1 (the line names the knob), read under the default."""
    data = jsonl(world["dir"] / "long.jsonl", GOOD * 4, json.dumps({"text": "word " * 400_000}))
    refused(world, "pretrain", data, f"{data} line 2", "longer than 1 MB", "MAX_RECORD_MB=1",
            extra=["--max_record_mb", "1"], here=capsys)
    with json_lines.record_limit(1):
        with pytest.raises(UsageError, match="line 2 is longer than 1 MB"):
            list(json_lines.jsonl_blocks(data))
    # default 64 MB: read whole
    assert sum(block.count(b"\n") for _, block in json_lines.jsonl_blocks(data)) == 21


@pytest.mark.parametrize("indent", [2, None], ids=["pretty", "one_line"])
@pytest.mark.parametrize("skip", ["0", "1"])
def test_a_json_list_saved_as_jsonl_is_said_to_be_one(world, base_model, capsys, indent, skip):
    """Round 5: "line 1: not valid JSON (SKIP_BAD_RECORDS=1 skips such records)", and with the knob set the
    same line and hint again; the one-line list was "unknown SFT format (no JSON objects)"."""
    data = world["dir"] / "chat.jsonl"
    data.write_text(json.dumps(GOOD_SFT, indent=indent))
    result = refused(
        world, "sft", data, extra=["--model_path", str(base_model), "--skip_bad_records", skip], here=capsys
    )
    assert result.stderr.strip() == (f"error: DATA_PATH: {data} is a JSON list ('[' on line 1), not JSON "
                                     f"lines (one "
                                     "record per line): name it .json, or write one record per line")
    if indent and skip == "0":  # pretraining's reader, too
        text = world["dir"] / "text.jsonl"
        text.write_text(json.dumps(GOOD, indent=indent))
        refused(world, "pretrain", text, "is a JSON list ('[' on line 1)", here=capsys)
