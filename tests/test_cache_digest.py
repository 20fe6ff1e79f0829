"""Caches verify what they claim (issue 37): a token shard rewritten in place with its size,
largest id and sum of ids kept (its ids reversed) and its mtime put back, and a cached tokenizer
with two ids swapped, are noticed and rebuilt; what trains is what a clean run trains, and the
tokenizer shipped in final/ is the clean one. A second start reads no shard (checked.json)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from suite_control import CpuSpent
from test_cache_tamper import clean, in_place, primed, run_with, trained  # noqa: F401 (clean: a fixture)

from train.data import cache_files, token_shards
from train.data import text as data


@pytest.fixture(autouse=True)
def _settled(monkeypatch):
    # As if every file were minutes old, so checks are remembered (as test_cache_tamper does).
    monkeypatch.setattr(cache_files, "SETTLED_NS", 0, raising=False)


def reversed_ids(b: bytearray) -> bytearray:
    ids = np.frombuffer(bytes(b), np.uint16)
    return bytearray(ids[::-1].tobytes())


def test_a_shard_reversed_in_place_is_caught_by_its_digest(
    clean, corpus, tiny_config, tmp_path, capsys  # noqa: F811
):
    cache, folder = primed(clean, corpus, tmp_path)
    shard = folder / "shard-00000.bin"
    ids = np.fromfile(shard, np.uint16)
    in_place(shard, reversed_ids)
    now = np.fromfile(shard, np.uint16)
    assert not np.array_equal(now, ids)  # a real change, that the old checks could not see:
    assert (now.max(), now.sum(dtype=np.uint64), len(now)) == (ids.max(), ids.sum(dtype=np.uint64), len(ids))
    capsys.readouterr()
    assert run_with(clean, cache, corpus, tiny_config, tmp_path) == 0
    out = capsys.readouterr().out
    assert "shard-00000.bin does not hold the bytes manifest.json describes (its sha256 differs)" in out
    assert "rebuilding it alone" in out
    assert np.array_equal(np.fromfile(shard, np.uint16), ids)
    assert trained(tmp_path / "runs" / "t") == clean.trained
    # The mended shard is checked once more (it was written seconds ago), then remembered by
    # identity in checked.json: later starts read no shard, so the digest is paid once.
    files = data.corpus_files(str(corpus))
    tok = data.load_tokenizer(str(clean.tok), files, "", 512, cache, print)
    opened = []
    real = token_shards._checked
    try:
        token_shards._checked = lambda *a: opened.append(a[1]["file"]) or real(*a)
        for _ in range(2):
            data.token_cache(files, data.corpus_fingerprint(files), tok, cache, print)
    finally:
        token_shards._checked = real
    assert opened == ["shard-00000.bin"]


def test_a_cached_tokenizer_with_two_ids_swapped_is_trained_again(corpus, tiny_config, tmp_path, capsys):
    cache = tmp_path / "cache"
    assert run_with_cache(cache, corpus, tiny_config, tmp_path, "clean") == 0
    (folder,) = (cache / "tokenizers").iterdir()
    assert (folder / cache_files.SEAL).is_file()
    clean_final = json.loads((tmp_path / "runs" / "clean" / "final" / "tokenizer.json").read_text())["model"][
        "vocab"
    ]
    tok_json = folder / "tokenizer.json"

    def swap(b: bytearray) -> bytearray:  # two ids of three digits exchanged: the same size
        vocab = json.loads(bytes(b))["model"]["vocab"]
        a, c = sorted(vocab, key=vocab.get)[300:302]
        text = bytes(b)
        for token, new in ((a, vocab[c]), (c, vocab[a])):
            entry = f"{json.dumps(token)}: {vocab[token]},".encode()
            assert text.count(entry) == 1
            text = text.replace(entry, f"{json.dumps(token)}: {new},".encode())
        assert len(text) == len(b) and text != bytes(b)
        return bytearray(text)

    in_place(tok_json, swap)
    capsys.readouterr()
    with CpuSpent() as cpu:
        assert run_with_cache(cache, corpus, tiny_config, tmp_path, "after") == 0
    out = capsys.readouterr().out
    assert (
        f"tokenizer cache {folder} was damaged (tokenizer.json does not hold the bytes kit-sha256.json" in out
    )
    assert cpu.spent < 120  # CPU seconds, not wall: a loaded machine stretches the wall
    final = json.loads((tmp_path / "runs" / "after" / "final" / "tokenizer.json").read_text())["model"][
        "vocab"
    ]
    assert final == clean_final
    assert cache_files.unsealed(folder) is None


def test_a_tokenizer_cache_of_an_older_kit_without_its_seal_is_trained_again(corpus, tmp_path):
    cache, notes = tmp_path / "cache", []
    files = data.corpus_files(str(corpus))
    key = data.corpus_fingerprint(files)
    first = data.load_tokenizer(None, files, key, 512, cache, notes.append).get_vocab()
    (folder,) = (cache / "tokenizers").iterdir()
    (folder / cache_files.SEAL).unlink()
    assert data.load_tokenizer(None, files, key, 512, cache, notes.append).get_vocab() == first
    assert any("kit-sha256.json is missing" in n and "rebuilding" in n for n in notes), notes
    shutil.rmtree(cache)


def run_with_cache(cache, corpus, tiny_config, tmp_path, name):
    from test_cache_tamper import pretrain

    return pretrain(cache, corpus, tiny_config, tmp_path / "runs", name)
