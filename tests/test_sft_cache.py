"""The SFT cache (train/data/chat/cache.py) and SFT's sources: parquet and Arrow rows read as JSON
records are, conversations tokenized once into memory-mapped files that a second start reuses
and that MAX_LENGTH or the template change, the same bytes whatever the number of workers, a
damaged cache rebuilt, and bad parquet as one line with exit code 2."""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess

import numpy as np
import pytest
from test_sft_data import make_tokenizer

from conftest import run_cli
from data_tools import write_arrow_folder, write_jsonl, write_parquet
from train.core.errors import UsageError
from train.data.chat.conversation_cache import sft_cache
from train.data.chat.encode import encode_conversations, ensure_special_tokens
from train.data.chat.formats import load_conversations

PAIRS = [{"prompt": f"Say {i} twice.", "response": f"{i} {i}." * (1 + i % 4)} for i in range(40)]
ALPACA = [
    {"instruction": f"Count to {i}.", "input": "", "output": " ".join(map(str, range(i + 1)))}
    for i in range(30)
]


@pytest.fixture
def tok():
    tokenizer = make_tokenizer()
    ensure_special_tokens(tokenizer)
    return tokenizer


def cached(path, tok, cache_dir, max_length=64, workers=1, skip=False, builtin=None):
    lines: list[str] = []
    examples, done = sft_cache(None if path is None else str(path), builtin, tok, max_length, skip, cache_dir,
                               workers, lines.append)
    return examples, done, lines


def test_parquet_and_arrow_rows_read_as_json_records(tmp_path, tok):
    jsonl = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    parquet = write_parquet(tmp_path / "pairs.parquet", PAIRS, row_group_rows=7)
    arrow = write_arrow_folder(tmp_path / "saved", ALPACA, batch_rows=8)
    want, fmt, _ = load_conversations(jsonl)
    assert (load_conversations(parquet)[:2], fmt) == ((want, "prompt_response"), "prompt_response")
    assert load_conversations(arrow)[1] == "alpaca" and len(load_conversations(arrow)[0]) == len(ALPACA)
    # Through the cache: the ids of the in-memory encoding, example by example.
    examples, _, _ = cached(parquet, tok, tmp_path / "cache")
    expected, _ = encode_conversations(want, tok, 64)
    assert [examples[i] for i in range(len(examples))] == expected
    assert examples.meta.format == "prompt_response"
    assert list(examples.lengths) == [len(e["input_ids"]) for e in expected]
    from_arrow, _, _ = cached(arrow, tok, tmp_path / "cache")  # a folder: every file of it is the key
    assert from_arrow.meta.format == "alpaca" and len(from_arrow) == len(ALPACA)
    assert from_arrow[3] == encode_conversations(load_conversations(arrow)[0], tok, 64)[0][3]


def test_second_start_reuses_the_cache_and_max_length_or_template_rebuild_it(tmp_path, tok):
    data = write_parquet(tmp_path / "d.parquet", PAIRS)
    first, done, lines = cached(data, tok, tmp_path / "c")
    assert done.startswith("SFT cache: built") and any("tokenizing 40 SFT records" in line for line in lines)
    again, done, lines = cached(data, tok, tmp_path / "c")
    assert done.startswith("SFT cache: reused") and lines == []
    assert again.folder == first.folder
    shorter, done, _ = cached(data, tok, tmp_path / "c", max_length=8)
    assert (
        done.startswith("SFT cache: built")
        and shorter.folder != first.folder
        and shorter.meta.n_truncated > 0
    )
    assert max(shorter.lengths) == 8
    tok.chat_template = tok.chat_template.replace("<|end|>\n", "<|end|>\n\n")
    _, done, _ = cached(data, tok, tmp_path / "c")
    assert done.startswith("SFT cache: built")
    data.write_bytes(write_parquet(tmp_path / "e.parquet", PAIRS[:-1]).read_bytes())  # new content, same name
    changed, done, _ = cached(data, tok, tmp_path / "c")
    assert done.startswith("SFT cache: built") and len(changed) == len(PAIRS) - 1


def test_workers_write_the_same_bytes_and_views_pickle_small(tmp_path, tok, monkeypatch):
    monkeypatch.setattr("train.data.chat.cache.CHUNK_ROWS", 7)  # several chunks in flight
    data = write_jsonl(tmp_path / "d.jsonl", PAIRS + ALPACA[:0])
    one, _, _ = cached(data, tok, tmp_path / "a", workers=1)
    two, _, _ = cached(data, tok, tmp_path / "b", workers=2)
    for name in ("ids.bin", "trained.bin", "lengths.bin", "meta.json"):
        assert (one.folder / name).read_bytes() == (two.folder / name).read_bytes(), name
    tail = one[len(one) - 5 :]
    assert len(tail) == 5 and tail[0] == one[len(one) - 5] and tail[-1] == one[-1]
    assert len(pickle.dumps(tail)) < 2000  # file names and lengths, not the tokens
    assert pickle.loads(pickle.dumps(tail))[4] == one[-1]


def test_damaged_cache_is_rebuilt_with_a_note(tmp_path, tok):
    data = write_jsonl(tmp_path / "d.jsonl", PAIRS)
    first, _, _ = cached(data, tok, tmp_path / "c")
    ids = first.folder / "ids.bin"
    ids.write_bytes(ids.read_bytes()[:-2])
    again, done, lines = cached(data, tok, tmp_path / "c")
    assert done.startswith("SFT cache: built") and any("was damaged (ids.bin holds" in line for line in lines)
    assert again[0] == first[0] and ids.stat().st_size == first.meta.n_tokens * 2
    (again.folder / "meta.json").unlink()
    _, _, lines = cached(data, tok, tmp_path / "c")
    assert any("meta.json is missing" in line for line in lines)
    assert not list((tmp_path / "c" / "sft").glob(".*.tmp*"))


def test_a_planted_link_in_the_sft_cache_is_removed_never_read(tmp_path, tok):
    data = write_jsonl(tmp_path / "d.jsonl", PAIRS)
    first, _, _ = cached(data, tok, tmp_path / "c")
    outside = tmp_path / "elsewhere.bin"
    outside.write_bytes((first.folder / "ids.bin").read_bytes())  # a file that would pass the checks
    (first.folder / "ids.bin").unlink()
    os.symlink(outside, first.folder / "ids.bin")
    again, done, lines = cached(data, tok, tmp_path / "c")
    assert done.startswith("SFT cache: built") and any("is a symbolic link" in line for line in lines)
    assert not (again.folder / "ids.bin").is_symlink() and again[0] == first[0]


def test_a_killed_build_leaves_nothing_that_outlives_it(tmp_path, tok):
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no process has now
    sft = tmp_path / "c" / "sft"
    mine = sft / f".abc.tmp-{socket.gethostname()}-{dead.pid}-0123abcd"
    other_host = sft / f".abc.tmp-elsewhere-{dead.pid}-0123abcd"  # a shared CACHE_DIR: not ours to judge
    alive = sft / f".abc.tmp-{socket.gethostname()}-{os.getpid()}-0123abcd"
    for folder in (mine, other_host, alive):
        folder.mkdir(parents=True)
    cached(write_jsonl(tmp_path / "d.jsonl", PAIRS), tok, tmp_path / "c")
    assert (mine.exists(), other_host.exists(), alive.exists()) == (False, True, True)


def test_bad_records_skipped_or_refused_and_nothing_cached(tmp_path, tok):
    rows = [*PAIRS[:3], {"prompt": "x", "response": " "}, *PAIRS[3:6]]
    data = write_parquet(tmp_path / "d.parquet", rows)
    with pytest.raises(UsageError, match=r"d\.parquet row 4: no response .*SKIP_BAD_RECORDS=1"):
        cached(data, tok, tmp_path / "c")
    # digests of the data only
    assert [p.name for p in (tmp_path / "c" / "sft").iterdir() if p.name != "sums"] == []
    examples, _, _ = cached(data, tok, tmp_path / "c", skip=True)
    assert (len(examples), examples.meta.n_skipped) == (6, 1)
    assert "row 4" in examples.meta.first_error


def test_builtin_conversations_go_through_the_cache(tmp_path, tok):
    convs = [
        [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}] for i in range(5)
    ]
    examples, done, _ = cached(None, tok, tmp_path / "c", builtin=convs)
    assert examples[2] == encode_conversations(convs, tok, 64)[0][2]
    _, done, _ = cached(None, tok, tmp_path / "c", builtin=convs)
    assert done.startswith("SFT cache: reused")


BAD_PARQUET = {
    "no_usable_column": (lambda p: write_parquet(p, [{"question": "a", "answer": "b"}]),
                         ["unknown SFT format", "keys: answer, question", "prompt_response"]),
    "corrupt": (lambda p: p.write_bytes(b"PAR1 this is not parquet at all PAR1"), ["not a readable parquet "
                                                                                   "file"]),
}


@pytest.mark.parametrize("case", list(BAD_PARQUET))
def test_bad_parquet_is_one_line_exit_2(case, base_model, tmp_path, capsys):
    make, expect = BAD_PARQUET[case]
    make(tmp_path / "bad.parquet")
    argv = ["--model_path", str(base_model), "--output_dir", str(tmp_path / "runs"), "--cache_dir",
            str(tmp_path / "c"), "--data_path", str(tmp_path / "bad.parquet"), "--max_steps", "1"]
    assert run_cli("sft", *argv) == 2
    # transformers' "Loading weights" bar (on when no earlier test turned it off) is not the error
    err = "\n".join(
        line for line in capsys.readouterr().err.strip().splitlines() if "Loading weights" not in line
    )
    assert len(err.splitlines()) == 1 and "bad.parquet" in err and all(e in err for e in expect), err


def test_parquet_prompt_response_trains_and_second_start_reads_the_cache(base_model, tmp_path):
    data = write_parquet(tmp_path / "guide.parquet", PAIRS)
    argv = ["--model_path", str(base_model), "--output_dir", str(tmp_path / "runs"), "--cache_dir",
            str(tmp_path / "c"), "--data_path", str(data), "--max_length", "64", "--batch_size", "4",
            "--max_steps", "2", "--tokenize_workers", "1"]
    assert run_cli("sft", *argv, "--run_name", "a") == 0
    assert run_cli("sft", *argv, "--run_name", "b") == 0
    logs = [(tmp_path / "runs" / n / "train.log").read_text() for n in "ab"]
    assert "tokenizing 40 SFT records" in logs[0] and "tokenizing" not in logs[1]
    assert "format prompt_response, 40 conversations; SFT cache: reused" in logs[1]
    rows = [json.loads(line) for n in "ab" for line in (tmp_path / "runs" / n / "metrics.jsonl").open()]
    assert np.isfinite([r["loss"] for r in rows if "loss" in r]).all()


def test_tokenize_workers_must_be_a_whole_number():
    from config import DataConfig

    with pytest.raises(UsageError, match="TOKENIZE_WORKERS"):
        DataConfig(tokenize_workers=0)
    assert DataConfig(tokenize_workers=1).tokenize_workers == 1  # at most the CPU cores
