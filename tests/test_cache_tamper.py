"""CACHE_DIR turned against the run (issue 30), each case made for real on a cache a tiny run or
the cache builders wrote: a manifest entry pointing outside the cache (with and without a
matching checked.json line), tokens/tokenizers/sums/sft planted as links, data and caches edited
in place with their times put back (os.utime, as `touch -r` does), a sums/ digest swapped for
another corpus's, the SFT cache's files zeroed, poisoned with their sum kept or out of the
vocabulary, a manifest claiming 4x the tokens. Each ends in a rebuild with a note or one line
(exit code 2); files outside are unchanged (bytes and mtime) and what trains is what a clean
run trains (the same losses, the same epoch)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from test_sft_data import make_tokenizer
from tiny_tools import one_thread

from conftest import make_text, read_jsonl, run_cli
from data_tools import write_jsonl
from train.core.errors import UsageError
from train.data import cache_files, token_shards, tokenize
from train.data import text as data
from train.data.chat import conversation_cache as chat_cache
from train.data.chat.encode import encode_conversations, ensure_special_tokens
from train.data.chat.formats import load_conversations

FAST = ["--vocab_size", "512", "--max_length", "64", "--batch_size", "4", "--max_steps", "2", "--seed", "3",
        "--log_every", "1", "--overwrite", "1", "--tokenize_workers", "1"]  # fmt: skip
LINK = ("is a symbolic link; the kit never writes or reads through a link in its own folders (remove it and "
        "run again)")
PAIRS = [{"prompt": f"Say {i} twice.", "response": f"{i} {i}." * (1 + i % 4)} for i in range(40)]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from one_thread()


@pytest.fixture(autouse=True)
def _settled(monkeypatch):
    # As if every file were minutes old: checks are remembered (checked.json, sums/), so the
    # remembered paths, where the attacks aim, are the ones exercised. A ctime cannot be set back.
    monkeypatch.setattr(cache_files, "SETTLED_NS", 0, raising=False)


def pretrain(cache: Path, corpus: Path, tiny_config: Path, runs: Path, name: str, *extra: str) -> int:
    return run_cli("pretrain", "--model_config", str(tiny_config), "--data_path", str(corpus), "--cache_dir",
                   str(cache), "--output_dir", str(runs), "--run_name", name, *FAST, *extra)  # fmt: skip


def trained(run: Path) -> tuple:
    """What a run trained on, as far as it shows: every step's loss, the validation loss, and
    the steps of one epoch (the number of sequences)."""
    rows = read_jsonl(run / "metrics.jsonl")
    epoch = re.search(r"one epoch is (\d+) steps", (run / "train.log").read_text()).group(1)
    return [r["loss"] for r in rows if "loss" in r], [r["val_loss"] for r in rows if "val_loss" in r], epoch


def snapshot(folder: Path) -> dict:
    """Every file under folder (links not followed): bytes and mtime."""
    return {p.relative_to(folder): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.rglob("*"))
            if p.is_file() and not p.is_symlink()}  # fmt: skip


def one_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and "Loading weights" not in line]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


def in_place(path: Path, edit) -> None:
    """Rewrite path's bytes in place (same inode, same size), then put its times back (`touch -r`)."""
    st = path.stat()
    data = edit(bytearray(path.read_bytes()))
    assert len(data) == st.st_size
    with open(path, "r+b") as handle:
        handle.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns, path.stat().st_ino) == (
        st.st_size,
        st.st_mtime_ns,
        st.st_ino,
    )


@pytest.fixture(scope="module")
def clean(corpus, tiny_config, cache_dir, tmp_path_factory):
    """A clean run's cache (token cache, sums/) and what it trained on, with a saved tokenizer."""
    root = tmp_path_factory.mktemp("clean")
    files = data.corpus_files(str(corpus))
    data.load_tokenizer(None, files, data.corpus_fingerprint(files), 512, cache_dir, print).save_pretrained(
        root / "tok"
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cache_files, "SETTLED_NS", 0, raising=False)
        assert (
            pretrain(
                root / "cache",
                corpus,
                tiny_config,
                root / "runs",
                "ref",
                "--tokenizer_path",
                str(root / "tok"),
            )
            == 0
        )
    return SimpleNamespace(cache=root / "cache", tok=root / "tok", trained=trained(root / "runs" / "ref"))


def primed(clean, corpus, tmp_path) -> tuple[Path, Path]:
    """A copy of the clean cache whose shards are checked and remembered (checked.json), as on
    any warm start: (the cache, its token folder)."""
    cache = tmp_path / "cache"
    shutil.copytree(clean.cache, cache)
    files = data.corpus_files(str(corpus))
    tok = data.load_tokenizer(str(clean.tok), files, "", 512, cache, print)
    # a copy: new inodes, checked once
    data.token_cache(files, data.corpus_fingerprint(files), tok, cache, print)
    (folder,) = (cache / "tokens").iterdir()
    assert (folder / "checked.json").is_file()
    return cache, folder


def run_with(clean, cache, corpus, tiny_config, tmp_path, name="t") -> int:
    return pretrain(cache, corpus, tiny_config, tmp_path / "runs", name, "--tokenizer_path", str(clean.tok))


@pytest.mark.parametrize("remembered", [False, True], ids=["F2i-rebuild", "C18-checked-json"])
def test_a_manifest_entry_outside_the_cache_is_never_written_or_read(remembered, clean, corpus, tiny_config,
                                                                     tmp_path, capsys):  # fmt: skip
    cache, folder = primed(clean, corpus, tmp_path)
    manifest = json.loads((folder / "manifest.json").read_text())
    entry = manifest["shards"][0]
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "x.bin").write_bytes(np.full(entry["tokens"], 7, np.uint16).tobytes())  # ids that would train
    name = "../../../outside/x.bin"
    assert (folder / name).resolve() == (outside / "x.bin").resolve()
    entry["file"] = name
    if remembered:  # the entry and its checked.json line agree with the file outside
        entry.update(max=7, sha256=hashlib.sha256((outside / "x.bin").read_bytes()).hexdigest())
        st = (outside / "x.bin").stat()
        line = [
            st.st_size,
            st.st_mtime_ns,
            st.st_ctime_ns,
            st.st_ino,
            *(entry[k] for k in ("tokens", "max", "sha256", "start", "end")),
        ]
        (folder / "checked.json").write_text(json.dumps({name: line}))
    (folder / "manifest.json").write_text(json.dumps(manifest))
    before = snapshot(outside)
    capsys.readouterr()
    assert run_with(clean, cache, corpus, tiny_config, tmp_path) == 0
    assert (
        "was damaged (manifest.json does not describe this token cache); rebuilding"
        in capsys.readouterr().out
    )
    assert snapshot(outside) == before and sorted(outside.iterdir()) == [outside / "x.bin"]
    assert trained(tmp_path / "runs" / "t") == clean.trained


@pytest.mark.parametrize("name", ["tokens", "tokenizers", "sums"])
def test_cache_folders_that_are_links_are_refused(
    name, clean, corpus, tiny_config, cache_dir, tmp_path, capsys
):
    cache = tmp_path / "cache"
    shutil.copytree(clean.cache, cache)
    elsewhere = tmp_path / "elsewhere"
    if name == "tokenizers":  # the corpus's trained tokenizer, where the run would load it from
        files = data.corpus_files(str(corpus))
        found = Path(
            data.load_tokenizer(
                None, files, data.corpus_fingerprint(files), 512, cache_dir, print
            ).name_or_path
        )
        shutil.copytree(found, elsewhere / found.name)
    else:
        shutil.move(cache / name, elsewhere)
    os.symlink(elsewhere, cache / name)
    before = snapshot(elsewhere)
    capsys.readouterr()
    extra = [] if name == "tokenizers" else ["--tokenizer_path", str(clean.tok)]
    assert pretrain(cache, corpus, tiny_config, tmp_path / "runs", "t", *extra) == 2
    assert one_error(capsys) == f"error: CACHE_DIR: {cache / name} {LINK}"
    assert snapshot(elsewhere) == before and (cache / name).is_symlink()
    assert not (tmp_path / "runs" / "t").exists()


@pytest.fixture
def sft_tok():
    tokenizer = make_tokenizer()
    ensure_special_tokens(tokenizer)
    return tokenizer


def sft_cached(path, tok, cache):
    notes: list[str] = []
    examples, done = chat_cache.sft_cache(str(path), None, tok, 64, False, cache, 1, notes.append)
    return examples, done, notes


@pytest.mark.parametrize("name", ["sft", "sft/sums"])
def test_sft_cache_folders_that_are_links_are_refused(name, sft_tok, tmp_path):
    jsonl = write_jsonl(tmp_path / "d.jsonl", PAIRS)
    cache = tmp_path / "cache"
    sft_cached(jsonl, sft_tok, cache)
    elsewhere = tmp_path / "elsewhere"
    shutil.move(cache / name, elsewhere)
    os.symlink(elsewhere, cache / name)
    before = snapshot(elsewhere)
    with pytest.raises(UsageError) as caught:
        sft_cached(jsonl, sft_tok, cache)
    assert str(caught.value) == f"CACHE_DIR: {cache / name} {LINK}"
    assert snapshot(elsewhere) == before


def test_data_edited_in_place_with_its_times_put_back_is_read_again(
    clean, corpus, tiny_config, tmp_path, capsys
):
    """C6: same size, same mtime (`touch -r`), new words: a new key, a new token cache of the
    new words; the old cache is not reused."""
    cache, _ = primed(clean, corpus, tmp_path)
    edited = tmp_path / "corpus.txt"
    shutil.copy2(corpus, edited)
    # remembers edited's digest in sums/
    assert run_with(clean, cache, edited, tiny_config, tmp_path, "a") == 0
    in_place(edited, lambda b: b.replace(b"quick", b"brown").replace(b"seven", b"eight"))
    capsys.readouterr()
    assert run_with(clean, cache, edited, tiny_config, tmp_path, "b") == 0
    assert "tokenizing 1 file(s) into the token cache" in capsys.readouterr().out
    tok = data.load_tokenizer(str(clean.tok), [edited], "", 512, cache, print)
    want = tok(edited.read_text(), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    key = data.corpus_fingerprint([edited])  # read whole, no memo
    assert np.array_equal(np.asarray(data.token_cache([edited], key, tok, cache, print)), want)
    assert trained(tmp_path / "runs" / "b") != trained(tmp_path / "runs" / "a")


def test_sft_data_edited_in_place_with_its_times_put_back_is_read_again(sft_tok, tmp_path):
    """SC10: the SFT cache of the old records is not reused."""
    jsonl = write_jsonl(tmp_path / "d.jsonl", PAIRS)
    first, _, _ = sft_cached(jsonl, sft_tok, tmp_path / "c")
    in_place(jsonl, lambda b: b.replace(b"Say 3 twice", b"Say 8 twice"))
    again, done, _ = sft_cached(jsonl, sft_tok, tmp_path / "c")
    want, _ = encode_conversations(load_conversations(jsonl)[0], sft_tok, 64)
    assert done.startswith("SFT cache: built") and again.folder != first.folder
    assert [again[i] for i in range(len(again))] == want != [first[i] for i in range(len(first))]


def test_a_sums_digest_swapped_for_another_corpus_is_not_taken(clean, corpus, tiny_config, tmp_path):
    """C9: sums/ memo of the corpus replaced by another corpus's (both real): the run trains on
    its own corpus, as the clean run did, not on the other one."""
    cache, _ = primed(clean, corpus, tmp_path)
    other = tmp_path / "other.txt"
    other.write_text(make_text(5, 12000))
    assert run_with(clean, cache, other, tiny_config, tmp_path, "other") == 0
    memos = {json.loads(p.read_text())["file"][0]: p for p in (cache / "sums").glob("*.json")}
    memos[str(corpus.resolve())].write_bytes(memos[str(other.resolve())].read_bytes())
    assert run_with(clean, cache, corpus, tiny_config, tmp_path) == 0
    assert trained(tmp_path / "runs" / "t") == clean.trained != trained(tmp_path / "runs" / "other")


def test_sft_sums_digest_swapped_for_another_files_is_not_taken(sft_tok, tmp_path):
    mine, theirs = write_jsonl(tmp_path / "a.jsonl", PAIRS[:10]), write_jsonl(tmp_path / "b.jsonl", PAIRS)
    sft_cached(theirs, sft_tok, tmp_path / "c")
    sft_cached(mine, sft_tok, tmp_path / "c")
    memos = {
        json.loads(p.read_text())["file"][0]: p for p in (tmp_path / "c" / "sft" / "sums").glob("*.json")
    }
    memos[str(mine.resolve())].write_bytes(memos[str(theirs.resolve())].read_bytes())
    examples, done, _ = sft_cached(mine, sft_tok, tmp_path / "c")
    assert done.startswith("SFT cache: reused") and len(examples) == 10


def test_a_shard_edited_in_place_with_its_mtime_put_back_is_rebuilt(
    clean, corpus, tiny_config, tmp_path, capsys
):
    """C5: out-of-vocabulary ids written into a remembered shard, times put back."""
    cache, folder = primed(clean, corpus, tmp_path)

    def poison(b: bytearray) -> bytearray:
        b[100:120] = b"\xff" * 20
        return b

    in_place(folder / "shard-00000.bin", poison)
    capsys.readouterr()
    assert run_with(clean, cache, corpus, tiny_config, tmp_path) == 0
    out = capsys.readouterr().out
    assert "shard-00000.bin holds id 65535, outside the tokenizer's" in out and "rebuilding it alone" in out
    assert trained(tmp_path / "runs" / "t") == clean.trained


def test_a_manifest_claiming_more_tokens_than_its_shard_holds_is_rebuilt(
    clean, corpus, tiny_config, tmp_path, capsys
):
    """C8: the manifest says 4x the tokens and checked.json's line was made to agree."""
    cache, folder = primed(clean, corpus, tmp_path)
    manifest = json.loads((folder / "manifest.json").read_text())
    memo = json.loads((folder / "checked.json").read_text())
    entry = manifest["shards"][0]
    entry["tokens"] *= 4
    manifest["n_tokens"] *= 4
    memo[entry["file"]][4] = entry["tokens"]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    (folder / "checked.json").write_text(json.dumps(memo))
    capsys.readouterr()
    assert run_with(clean, cache, corpus, tiny_config, tmp_path) == 0
    assert "rebuilding the whole cache" in capsys.readouterr().out
    assert trained(tmp_path / "runs" / "t") == clean.trained


def zero(b: bytearray) -> bytearray:
    return bytearray(len(b))


def keep_sum(b: bytearray) -> bytearray:
    lengths = np.frombuffer(bytes(b), np.int32).copy()
    lengths[0], lengths[1] = lengths[0] + 5, lengths[1] - 5  # the sum (the token count) kept
    return bytearray(lengths.tobytes())


def out_of_vocabulary(b: bytearray) -> bytearray:
    ids = np.frombuffer(bytes(b), np.uint16).copy()
    ids[3:9] = 65535
    return bytearray(ids.tobytes())


@pytest.fixture(scope="module")
def sft_clean(base_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    jsonl = write_jsonl(root / "pairs.jsonl", PAIRS)
    argv = ["--model_path", str(base_model), "--output_dir", str(root / "runs"), "--data_path", str(jsonl),
            "--max_length", "64", "--batch_size", "4", "--max_steps", "2", "--seed", "3", "--log_every", "1",
            "--tokenize_workers", "1", "--overwrite", "1"]  # fmt: skip
    assert run_cli("sft", *argv, "--cache_dir", str(root / "cache"), "--run_name", "ref") == 0
    return SimpleNamespace(
        argv=argv, cache=root / "cache", runs=root / "runs", trained=trained(root / "runs" / "ref")
    )


@pytest.mark.parametrize(
    "file, damage, forged",
    [
        ("trained.bin", zero, False),
        ("lengths.bin", keep_sum, False),
        ("ids.bin", out_of_vocabulary, False),
        ("ids.bin", out_of_vocabulary, True),
    ],
    ids=["SC5-trained-zeroed", "SC3-lengths-sum-kept", "SC4-ids-out-of-vocab", "SC4-meta-json-rehashed"],
)
def test_a_tampered_sft_cache_is_rebuilt_never_trained_on(file, damage, forged, sft_clean, tmp_path, capsys):
    cache = tmp_path / "cache"
    shutil.copytree(sft_clean.cache, cache)
    (folder,) = [p for p in (cache / "sft").iterdir() if p.name != "sums"]
    assert chat_cache.open_cache(folder)[0] is not None and (folder / "checked.json").is_file()  # remembered
    in_place(folder / file, damage)
    note = f"{file} does not hold the bytes meta.json's checksum describes"
    if forged:  # meta.json's checksum made to agree: the ids are still checked against the vocabulary
        meta = json.loads((folder / "meta.json").read_text())
        meta["sha256"][file] = hashlib.sha256((folder / file).read_bytes()).hexdigest()
        (folder / "meta.json").write_text(json.dumps(meta))
        note = "ids.bin holds id 65535, outside the tokenizer's"
    capsys.readouterr()
    assert run_cli("sft", *sft_clean.argv, "--cache_dir", str(cache), "--run_name", "t") == 0
    out = capsys.readouterr().out
    assert f"was damaged ({note}" in out and "rebuilding" in out
    assert trained(sft_clean.runs / "t") == sft_clean.trained


def test_a_manifest_cut_short_is_not_served_as_the_whole_corpus(clean, corpus, tiny_config, tmp_path, capsys,
                                                                monkeypatch):
    """Review finding: the last shard entries deleted from a complete manifest (each left entry
    sound) served part of the corpus silently; the count no longer adds up, so it is rebuilt."""
    monkeypatch.setattr(tokenize, "UNIT_SIZE", 4096)  # several shards from the small corpus
    monkeypatch.setattr(token_shards, "SHARD_SIZE", 16384)
    cache = tmp_path / "cache"
    assert run_with(clean, cache, corpus, tiny_config, tmp_path, "first") == 0
    (folder,) = [p for p in (cache / "tokens").iterdir() if p.is_dir()]
    manifest = json.loads((folder / "manifest.json").read_text())
    assert len(manifest["shards"]) >= 2
    manifest["shards"] = manifest["shards"][:1]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    assert run_with(clean, cache, corpus, tiny_config, tmp_path) == 0
    assert "manifest.json does not describe this token cache" in capsys.readouterr().out
    assert trained(tmp_path / "runs" / "t") == trained(tmp_path / "runs" / "first")


def signed_ids(folder: Path) -> None:
    """ids.bin's uint16 ids read as int16 with one id made -1 (0xFFFF), meta.json made to agree."""
    ids = np.fromfile(folder / "ids.bin", np.uint16)
    ids[3] = 0xFFFF
    ids.tofile(folder / "ids.bin")
    meta = json.loads((folder / "meta.json").read_text())
    meta["dtype"], meta["sha256"]["ids.bin"] = (
        "int16",
        hashlib.sha256((folder / "ids.bin").read_bytes()).hexdigest(),
    )
    (folder / "meta.json").write_text(json.dumps(meta))


def negative_lengths(folder: Path) -> None:
    lengths = np.fromfile(folder / "lengths.bin", np.int32)
    lengths[0], lengths[1] = -1000, lengths[1] + lengths[0] + 1000  # the sum kept
    lengths.tofile(folder / "lengths.bin")
    meta = json.loads((folder / "meta.json").read_text())
    meta["sha256"]["lengths.bin"] = hashlib.sha256((folder / "lengths.bin").read_bytes()).hexdigest()
    (folder / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize(
    "forge, note",
    [(signed_ids, "ids of type int16"), (negative_lengths, "lengths.bin")],
    ids=["signed-id-type", "negative-lengths"],
)
def test_a_forged_sft_meta_json_cannot_smuggle_bad_ids_or_lengths(forge, note, sft_clean, tmp_path, capsys):
    cache = tmp_path / "cache"
    shutil.copytree(sft_clean.cache, cache)
    (folder,) = [p for p in (cache / "sft").iterdir() if p.name != "sums"]
    forge(folder)
    capsys.readouterr()
    assert run_cli("sft", *sft_clean.argv, "--cache_dir", str(cache), "--run_name", "t") == 0
    out = capsys.readouterr().out
    assert "was damaged" in out and note in out and "rebuilding" in out
    assert trained(sft_clean.runs / "t") == sft_clean.trained
