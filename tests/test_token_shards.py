"""The sharded token cache: tokenized in worker processes, resumed after an interruption to the
same bytes, a damaged shard (ids out of the vocabulary included) rebuilt alone; pretraining
on parquet / Arrow / mixed folders end to end."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import ROOT, make_text, run_cli
from data_tools import write_arrow_folder, write_jsonl, write_parquet
from train.core.errors import Interrupted
from train.data import cache_files, token_shards, tokenize
from train.data import text as data


@pytest.fixture
def small_shards(monkeypatch):
    """Units of ~4 KB and shards of ~16 KB, so a small corpus makes many of each."""
    monkeypatch.setattr(tokenize, "UNIT_SIZE", 4096)
    monkeypatch.setattr(token_shards, "SHARD_SIZE", 16384)


@pytest.fixture(scope="module")
def docs_corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("docs")
    rows = [{"text": make_text(i, 8), "n": i} for i in range(400)]  # ~200 KB in all
    write_jsonl(folder / "a.jsonl", rows[:150])
    write_parquet(folder / "b.parquet", rows[150:300], row_group_rows=40)
    (folder / "c.txt").write_text(make_text(999, 300))
    return folder


@pytest.fixture(scope="module")
def tok(docs_corpus, tmp_path_factory):
    # Its own cache: the shared one holds only the corpus fixture's tokenizer (test_cache picks it).
    files = data.corpus_files(str(docs_corpus))
    return data.load_tokenizer(
        None, files, data.corpus_fingerprint(files), 512, tmp_path_factory.mktemp("tok"), print
    )


def build(folder, tok, cache, workers=1):
    files = data.corpus_files(str(folder))
    tokens = data.token_cache(files, data.corpus_fingerprint(files), tok, cache, print, "text", workers)
    shards = sorted((cache / "tokens").glob("*/shard-*.bin"))
    return np.asarray(tokens), shards


def reference_ids(folder, tok) -> np.ndarray:
    """The token stream as the tokenizer gives it, document by document."""
    eos = tok.convert_tokens_to_ids(tok.eos_token)
    ids = []
    for path in data.corpus_files(str(folder)):
        doc = []
        for piece in data.records.iter_texts(path):
            if piece:
                doc.append(piece)
            else:
                ids += tok("".join(doc), add_special_tokens=False)["input_ids"] + [eos]
                doc = []
    return np.array(ids)


def test_workers_build_the_same_stream_as_one_process(small_shards, docs_corpus, tok, tmp_path, monkeypatch):
    monkeypatch.setattr(tokenize, "POOL_MIN_BYTES", 0)
    one, shards = build(docs_corpus, tok, tmp_path / "one", workers=1)
    assert len(shards) >= 4
    np.testing.assert_array_equal(one, reference_ids(docs_corpus, tok))
    two, shards2 = build(docs_corpus, tok, tmp_path / "two", workers=2)  # a real spawn pool
    assert [p.read_bytes() for p in shards2] == [p.read_bytes() for p in shards]
    stream = data.token_shards.TokenStream(shards, [p.stat().st_size // 2 for p in shards], np.uint16)
    np.testing.assert_array_equal(stream[1000:30000], one[1000:30000])  # slices across shards
    ds = data.PackedDataset(stream, 64)
    assert len(ds) == len(one) // 64 and ds[100]["input_ids"].tolist() == one[6400:6464].tolist()


def test_interrupted_build_continues_to_the_same_bytes(
    small_shards, docs_corpus, tok, tmp_path, monkeypatch, capsys
):
    whole, shards = build(docs_corpus, tok, tmp_path / "whole")
    want = [p.read_bytes() for p in shards]
    real, calls = token_shards._ShardFile.__init__, []

    def stop_in_the_fourth(self, *args):
        real(self, *args)
        calls.append(1)
        if len(calls) == 4:  # Ctrl+C with the fourth shard's temporary file open
            raise KeyboardInterrupt

    monkeypatch.setattr(token_shards._ShardFile, "__init__", stop_in_the_fourth)
    with pytest.raises(Interrupted, match="3 finished shard.s. kept: the next run continues"):
        build(docs_corpus, tok, tmp_path / "cut")
    monkeypatch.setattr(token_shards._ShardFile, "__init__", real)  # (undo() would drop small_shards too)
    capsys.readouterr()
    again, shards = build(docs_corpus, tok, tmp_path / "cut")
    assert "after its 3 finished shard(s)" in capsys.readouterr().out
    assert [p.read_bytes() for p in shards] == want
    assert not [p for p in (tmp_path / "cut").rglob("*") if ".tmp" in p.name]


KILL_AFTER_FIRST_SHARD = """
import os, signal, sys
from pathlib import Path
from train.data import cache_files, text as data, token_shards, tokenize
tokenize.UNIT_SIZE, token_shards.SHARD_SIZE = 4096, 16384
real = cache_files.write_json
def write_then_die(path, value):
    real(path, value)
    if len(value["shards"]) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
cache_files.write_json = write_then_die
folder, tok_dir, cache = sys.argv[1:]
files = data.corpus_files(folder)
tok = data.load_tokenizer(tok_dir, files, "k", 512, Path(cache), print)
data.token_cache(files, data.corpus_fingerprint(files), tok, Path(cache), print)
"""


def test_sigkilled_build_keeps_its_shards(small_shards, docs_corpus, tok, tmp_path):
    tok.save_pretrained(tmp_path / "tok")
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(tmp_path / "tok")
    _, shards = build(docs_corpus, saved, tmp_path / "whole")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [
        sys.executable,
        "-c",
        KILL_AFTER_FIRST_SHARD,
        str(docs_corpus),
        str(tmp_path / "tok"),
        str(tmp_path / "cut"),
    ]
    result = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == -signal.SIGKILL, result.stderr
    manifest = json.loads(next((tmp_path / "cut" / "tokens").glob("*/manifest.json")).read_text())
    assert len(manifest["shards"]) == 2 and not manifest.get("complete")
    _, resumed = build(docs_corpus, saved, tmp_path / "cut")
    assert [p.read_bytes() for p in resumed] == [p.read_bytes() for p in shards]


@pytest.mark.parametrize("damage", ["out_of_vocabulary", "cut"])
def test_damaged_shard_is_rebuilt_alone(damage, small_shards, docs_corpus, tok, tmp_path, capsys):
    _, shards = build(docs_corpus, tok, tmp_path / "c")
    want = [p.read_bytes() for p in shards]
    victim = shards[2]
    if damage == "out_of_vocabulary":  # same size, ids past the vocabulary (an IndexError in training)
        victim.write_bytes(b"\xff\xff" * (victim.stat().st_size // 2))
    else:
        victim.write_bytes(victim.read_bytes()[:100])
    times = {p: p.stat().st_mtime_ns for p in shards if p != victim}
    capsys.readouterr()
    _, again = build(docs_corpus, tok, tmp_path / "c")
    out = capsys.readouterr().out
    assert f"shard {victim} was damaged (" in out and "rebuilding it alone" in out
    if damage == "out_of_vocabulary":
        assert "holds id 65535, outside the tokenizer's" in out
    assert [p.read_bytes() for p in again] == want
    assert all(p.stat().st_mtime_ns == t for p, t in times.items())  # the others untouched


def test_a_settled_shard_is_checked_once_then_remembered(
    small_shards, docs_corpus, tok, tmp_path, monkeypatch
):
    """A warm start does not read every shard again: one checked and older than SETTLED_NS is
    remembered (checked.json) by size, mtime, ctime and inode; a shard changed since is read again."""
    want, shards = build(docs_corpus, tok, tmp_path / "c")
    old = time.time() - 60
    for p in shards:
        os.utime(p, (old, old))
    # settled: a ctime cannot be set back, so "older than the timestamp granularity" is moved instead
    monkeypatch.setattr(cache_files, "SETTLED_NS", 0)
    reads = []
    real = token_shards._checked
    monkeypatch.setattr(
        token_shards,
        "_checked",
        lambda folder, entry, *a: reads.append(entry["file"]) or real(folder, entry, *a),
    )
    build(docs_corpus, tok, tmp_path / "c")
    assert len(reads) == len(shards) > 2 and (shards[0].parent / token_shards.CHECKED).is_file()
    reads.clear()
    got, _ = build(docs_corpus, tok, tmp_path / "c")
    assert reads == [] and np.array_equal(got, want)
    shards[1].write_bytes(b"\xff\xff" * (shards[1].stat().st_size // 2))  # same size, new mtime
    out = build(docs_corpus, tok, tmp_path / "c")
    assert reads == [shards[1].name] and np.array_equal(out[0], want)


def test_pretraining_on_parquet_and_arrow_with_text_field(tmp_path, tiny_config, capsys):
    rows = [{"body": make_text(i, 6), "id": i} for i in range(300)]
    folder = tmp_path / "mixed"
    folder.mkdir()
    write_parquet(folder / "a.parquet", rows[:150])
    write_arrow_folder(folder / "saved", rows[150:])
    argv = [
        "--model_config",
        str(tiny_config),
        "--data_path",
        str(folder),
        "--text_field",
        "body",
        "--vocab_size",
        "512",
        "--cache_dir",
        str(tmp_path / "cache"),
        "--output_dir",
        str(tmp_path / "runs"),
        "--max_length",
        "32",
        "--batch_size",
        "4",
        "--max_steps",
        "1",
        "--tokenizer_sample_mb",
        "0.01",
    ]
    assert run_cli("pretrain", *argv, "--run_name", "a") == 0
    out = capsys.readouterr().out
    assert "on a 0.01 MB sample of the" in out and "cached " in out
    assert run_cli("pretrain", *argv[:5], "text", *argv[6:], "--run_name", "b") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and 'a.parquet has no column "text"' in err[0]
    (folder / "a.parquet").write_bytes(b"PAR1 not really parquet")
    assert run_cli("pretrain", *argv, "--run_name", "c") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a.parquet: not a readable parquet file" in err[0]
    assert not (tmp_path / "runs" / "b").exists() and not (tmp_path / "runs" / "c").exists()


def test_one_process_builds_while_the_others_wait(docs_corpus, tok, tmp_path):
    """torchrun's ranks (or two runs) on one CACHE_DIR: whoever holds the lock builds; the others
    say they wait, then open the finished cache without building it again."""
    import threading

    cache = tmp_path / "cache"
    (cache / "tokens").mkdir(parents=True)
    said: list[str] = []
    files = data.corpus_files(str(docs_corpus))
    key = data.corpus_fingerprint(files)
    result = {}

    def other_rank():
        result["tokens"] = data.token_cache(files, key, tok, cache, said.append)

    with token_shards.locked(cache / "tokens", "a token cache", print):
        waiter = threading.Thread(target=other_rank)
        waiter.start()
        waiter.join(timeout=1.0)
        assert waiter.is_alive() and said == [f"waiting for another process building a token cache in "
                                              f"{cache / 'tokens'}"]
    waiter.join(timeout=60)
    assert not waiter.is_alive() and any(line.startswith("cached ") for line in said)
    said.clear()
    again = data.token_cache(files, key, tok, cache, said.append)  # built once: now only opened
    assert not any("tokenizing" in line for line in said)
    np.testing.assert_array_equal(np.asarray(again), np.asarray(result["tokens"]))


def test_full_disk_after_two_shards_keeps_them(small_shards, docs_corpus, tok, tmp_path, monkeypatch):
    import errno

    from train.core.errors import UsageError

    _, shards = build(docs_corpus, tok, tmp_path / "whole")
    real = token_shards._ShardFile.add

    def fills_up(self, ids):
        if self.path.name == "shard-00002.bin":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(self, ids)

    monkeypatch.setattr(token_shards._ShardFile, "add", fills_up)
    with pytest.raises(UsageError) as caught:
        build(docs_corpus, tok, tmp_path / "full")
    message = str(caught.value)
    assert message.startswith("CACHE_DIR: cannot write the token cache ") and "\n" not in message
    assert message.endswith("shard-00002.bin: No space left on device; 2 finished shard(s) kept: the next "
                            "run continues from there")
    monkeypatch.setattr(token_shards._ShardFile, "add", real)
    _, resumed = build(docs_corpus, tok, tmp_path / "full")
    assert [p.read_bytes() for p in resumed] == [p.read_bytes() for p in shards]
    assert not [p for p in (tmp_path / "full").rglob("*") if ".tmp" in p.name]
