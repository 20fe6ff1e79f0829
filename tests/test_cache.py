"""CACHE_DIR: unusable folders, a full disk, damaged caches and Ctrl+C while building them end in
one line (exit code 2, or 130 for Ctrl+C), leave no temporary file, and a later run works."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import ROOT, make_text, run_cli, train_python
from train.core import files
from train.core.errors import UsageError
from train.data import cache_files
from train.data import text as data

SMALL_RUN = ["--vocab_size", "512", "--max_length", "64", "--batch_size", "4", "--max_steps", "1"]


def leftovers(cache: Path) -> list[str]:
    """Temporary files or folders anywhere under the cache."""
    return [str(p) for p in cache.rglob("*") if ".tmp" in p.name or p.name.startswith("tmp")]


@pytest.fixture
def fresh_cache(tmp_path, corpus, cache_dir) -> Path:
    """An empty token cache with this corpus's tokenizer already in it (no tokenizer training),
    and only that one: the shared cache holds other tests' tokenizers too."""
    files = data.corpus_files(str(corpus))
    for _ in range(2):  # the second call loads it from its folder, which names it
        tok = data.load_tokenizer(None, files, data.corpus_fingerprint(files), 512, cache_dir, print)
    folder = Path(tok.name_or_path)
    cache = tmp_path / "cache"
    shutil.copytree(folder, cache / "tokenizers" / folder.name)
    return cache


def pretrain(cache: Path, corpus, tiny_config, tmp_path, *extra: str) -> int:
    return run_cli(
        "pretrain", "--model_config", str(tiny_config), "--data_path", str(corpus), "--cache_dir", str(cache),
        "--output_dir", str(tmp_path / "runs"), "--overwrite", "1", *SMALL_RUN, *extra,
    )  # fmt: skip


def error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


class FillsUp:
    """A file that takes `room` bytes, then fails like a full disk."""

    def __init__(self, handle, room: int):
        self.handle, self.room = handle, room

    def write(self, chunk):
        if len(chunk) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(chunk)
        return self.handle.write(chunk)

    def __getattr__(self, name):
        return getattr(self.handle, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.close()


def full_disk(monkeypatch, module, room: int) -> None:
    """Files the module opens for writing hold `room` bytes; reads are untouched."""

    def fake_open(path, mode="r", *args, **kwargs):
        handle = open(path, mode, *args, **kwargs)
        return FillsUp(handle, room) if "w" in mode else handle

    monkeypatch.setattr(module, "open", fake_open, raising=False)


@pytest.mark.parametrize("kind", ["proc", "file"])
def test_cache_dir_that_cannot_be_created(kind, tmp_path, corpus, tiny_config, capsys):
    if kind == "proc":
        cache = Path("/proc/no-such-cache")
    else:
        cache = tmp_path / "a-file"
        cache.write_text("not a folder")
    assert pretrain(cache, corpus, tiny_config, tmp_path) == 2
    line = error_line(capsys)
    assert line.startswith("error: CACHE_DIR: ") and str(cache) in line
    assert not (tmp_path / "runs").exists()


def test_disk_full_while_writing_the_token_cache(
    fresh_cache, corpus, tiny_config, tmp_path, monkeypatch, capsys
):
    full_disk(monkeypatch, files, room=10_000)
    assert pretrain(fresh_cache, corpus, tiny_config, tmp_path) == 2
    line = error_line(capsys)
    assert line.startswith("error: CACHE_DIR: cannot write the token cache ")
    assert str(fresh_cache / "tokens") in line and line.endswith("shard-00000.bin: No space left on device")
    assert list((fresh_cache / "tokens").iterdir()) == []  # neither the shard nor its .tmp file
    monkeypatch.undo()
    assert pretrain(fresh_cache, corpus, tiny_config, tmp_path) == 0


def test_disk_full_while_writing_the_manifest(
    fresh_cache, corpus, tiny_config, tmp_path, monkeypatch, capsys
):
    def full(path, value):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(cache_files, "write_json", full)  # the shard is written, its manifest entry not
    assert pretrain(fresh_cache, corpus, tiny_config, tmp_path) == 2
    assert error_line(capsys).endswith("shard-00000.bin: No space left on device")
    # A .bin without its manifest would be taken for a damaged cache next time: removed too.
    assert list((fresh_cache / "tokens").iterdir()) == []


def test_disk_full_while_saving_the_tokenizer(tmp_path, corpus, tiny_config, monkeypatch, capsys):
    from transformers import PreTrainedTokenizerFast

    real = PreTrainedTokenizerFast.save_pretrained

    def save_then_fill_up(self, folder, *args, **kwargs):
        real(self, folder, *args, **kwargs)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(PreTrainedTokenizerFast, "save_pretrained", save_then_fill_up)
    cache = tmp_path / "cache"
    assert pretrain(cache, corpus, tiny_config, tmp_path) == 2
    line = error_line(capsys)
    assert line.startswith(f"error: CACHE_DIR: cannot write the tokenizer {cache / 'tokenizers'}/bpe-512-")
    assert line.endswith(": No space left on device")
    assert list((cache / "tokenizers").iterdir()) == []


def test_bad_file_met_while_tokenizing_leaves_no_temp_file(
    fresh_cache, corpus, tiny_config, tmp_path, capsys
):
    folder = tmp_path / "data"
    folder.mkdir()
    shutil.copy(corpus, folder / "a.txt")
    (folder / "b.txt").write_bytes(b"fine so far \xff then not UTF-8")
    files = data.corpus_files(str(folder))
    key = data.corpus_fingerprint(files)
    tok = data.load_tokenizer(None, [corpus], key, 512, fresh_cache, print)  # b.txt is met while tokenizing
    with pytest.raises(UsageError, match="b.txt is not UTF-8"):
        data.token_cache(files, key, tok, fresh_cache, print)
    assert list((fresh_cache / "tokens").iterdir()) == []


def test_other_file_system_errors_are_one_line(monkeypatch, capsys):
    import train.cli

    def fails(*_):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), "/mnt/ro/x")

    monkeypatch.setattr(train.cli, "main", fails)
    assert run_cli("pretrain") == 2
    assert error_line(capsys) == "error: file-system error (/mnt/ro/x): Read-only file system"

    def bug(*_):  # a file the code itself should have made: a bug, whose traceback is wanted
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), "/x")

    monkeypatch.setattr(train.cli, "main", bug)
    with pytest.raises(FileNotFoundError):
        run_cli("pretrain")


def cut_in_half(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize(
    "damage, note",
    [
        (lambda bin_path, meta: cut_in_half(bin_path), "token cache"),
        (lambda bin_path, meta: cut_in_half(meta), "token cache"),
        (lambda bin_path, meta: meta.unlink(), "token cache"),
        (
            lambda bin_path, meta: cut_in_half(next(bin_path.parents[2].glob("tokenizers/*/tokenizer.json"))),
            "tokenizer cache",
        ),
    ],
    ids=["bin-truncated", "json-cut", "json-missing", "tokenizer-json-cut"],
)
def test_damaged_cache_is_rebuilt(damage, note, fresh_cache, corpus, tiny_config, tmp_path, capsys):
    assert pretrain(fresh_cache, corpus, tiny_config, tmp_path) == 0
    bin_path = next((fresh_cache / "tokens").glob("*/shard-*.bin"))
    meta = bin_path.with_name("manifest.json")
    tokens = bin_path.read_bytes()
    capsys.readouterr()
    damage(bin_path, meta)
    assert pretrain(fresh_cache, corpus, tiny_config, tmp_path) == 0
    out = capsys.readouterr().out
    assert f"{note} " in out and "was damaged (" in out and "); rebuilding" in out
    assert bin_path.read_bytes() == tokens  # the same tokens as before: same tokenizer, same data
    assert not leftovers(fresh_cache)
    capsys.readouterr()
    assert pretrain(fresh_cache, corpus, tiny_config, tmp_path) == 0
    assert "was damaged (" not in capsys.readouterr().out  # mended for good


# Ctrl+C in a real process: a corpus big enough that tokenizer training and tokenizing each
# take a few seconds, the signal sent once the log says that step has started.


@pytest.fixture(scope="module")
def big_corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("big") / "big.txt"
    path.write_text(make_text(1, 200_000))  # ~10 MB
    return path


def default_sigint() -> None:
    # A job started in the background by a non-interactive shell inherits SIGINT ignored, and a
    # Python started with SIGINT ignored never raises KeyboardInterrupt: give the run Ctrl+C back.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def interrupt_when(argv: list[str], marker: str, sig: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [train_python(), "-m", "train", "pretrain", *argv], cwd=ROOT, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=default_sigint,
    )  # fmt: skip
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if marker in line:
                time.sleep(0.3)
                proc.send_signal(sig)
                break
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert any(marker in line for line in seen), "".join(seen)
    return subprocess.CompletedProcess(proc.args, proc.returncode, "".join(seen) + out, err)


def test_ctrl_c_while_training_the_tokenizer(big_corpus, tiny_config, tmp_path):
    cache = tmp_path / "cache"
    argv = ["--model_config", str(tiny_config), "--data_path", str(big_corpus), "--cache_dir", str(cache),
            "--output_dir", str(tmp_path / "runs"), *SMALL_RUN]  # fmt: skip
    result = interrupt_when(argv, "training a byte-level BPE tokenizer", signal.SIGINT)
    assert result.returncode == 130, result.stderr
    assert result.stderr.strip() == "interrupted while training the tokenizer; nothing was saved"
    assert list((cache / "tokenizers").iterdir()) == []
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupt_while_tokenizing(sig, big_corpus, tiny_config, tmp_path, corpus, cache_dir):
    # A saved tokenizer (TOKENIZER_PATH): the run goes straight to tokenizing the big corpus.
    files = data.corpus_files(str(corpus))
    tok = data.load_tokenizer(None, files, data.corpus_fingerprint(files), 512, cache_dir, print)
    tok.save_pretrained(tmp_path / "tokenizer")
    cache = tmp_path / "cache"
    argv = [
        "--model_config",
        str(tiny_config),
        "--data_path",
        str(big_corpus),
        "--cache_dir",
        str(cache),
        "--tokenizer_path",
        str(tmp_path / "tokenizer"),
        "--output_dir",
        str(tmp_path / "runs"),
        *SMALL_RUN,
    ]
    result = interrupt_when(argv, "tokenizing 1 file(s) into the token cache", sig)
    assert result.returncode == 128 + sig, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip() == "interrupted while building the token cache; nothing was saved"
    assert list((cache / "tokens").iterdir()) == []
