"""train/core/files.py with real planted links and real write failures: a write never follows a
link (the file outside is unchanged and nothing is written outside), a failed write leaves the
old file and no temporary file, an append lands whole or not at all."""

import errno
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from train.core import files


@pytest.fixture
def outside(tmp_path):
    """A file outside the folder the kit writes in, and that folder."""
    secret = tmp_path / "outside" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("do not touch\n")
    folder = tmp_path / "run"
    folder.mkdir()
    return secret, folder


def untouched(secret, tmp_path):
    assert secret.read_text() == "do not touch\n"
    assert sorted(p.name for p in secret.parent.iterdir()) == ["secret.txt"]


def test_atomic_write_replaces_a_link_at_the_target_without_following_it(outside, tmp_path):
    secret, folder = outside
    os.symlink(secret, folder / "summary.json")
    files.write_json(folder / "summary.json", {"loss": float("nan"), "steps": 2})
    untouched(secret, tmp_path)
    assert not (folder / "summary.json").is_symlink()
    assert json.loads((folder / "summary.json").read_text()) == {"loss": None, "steps": 2}
    assert sorted(p.name for p in folder.iterdir()) == ["summary.json"]


def test_a_link_planted_at_temporary_names_is_never_written_through(outside, tmp_path, monkeypatch):
    secret, folder = outside
    names = iter(["aaaa0000", "aaaa0000", "bbbb1111"])  # the first two draws hit the planted link
    monkeypatch.setattr(files.secrets, "token_hex", lambda n: next(names))
    os.symlink(secret, folder / ".summary.json.aaaa0000.tmp")
    os.symlink(secret, folder / ".summary.json.tmp")  # the fixed name older kits used
    files.atomic_write(folder / "summary.json", "{}\n")
    untouched(secret, tmp_path)
    assert (folder / "summary.json").read_text() == "{}\n" and not (folder / "summary.json").is_symlink()
    assert (folder / ".summary.json.aaaa0000.tmp").is_symlink()  # left alone, neither followed nor used


def test_every_name_taken_is_one_error_naming_the_file(outside, monkeypatch):
    secret, folder = outside
    monkeypatch.setattr(files.secrets, "token_hex", lambda n: "cccc2222")
    os.symlink(secret, folder / ".config.json.cccc2222.tmp")
    with pytest.raises(OSError) as caught:
        files.write_json(folder / "config.json", {})
    assert caught.value.errno == errno.EEXIST and caught.value.filename == str(folder / "config.json")
    assert not (folder / "config.json").exists()


def test_append_refuses_a_link(outside, tmp_path):
    secret, folder = outside
    os.symlink(secret, folder / "metrics.jsonl")
    with pytest.raises(files.LinkRefused) as caught:
        files.open_append(folder / "metrics.jsonl")
    assert str(folder / "metrics.jsonl") in str(caught.value) and "symbolic link" in str(caught.value)
    untouched(secret, tmp_path)
    with pytest.raises(files.LinkRefused):
        files.read_text(folder / "metrics.jsonl")


def test_remove_and_replace_folder_never_follow_links(outside, tmp_path):
    secret, folder = outside
    os.symlink(secret.parent, folder / ".final.old-123")  # a leftover pointing at a folder outside
    files.remove(folder / ".final.old-123")
    untouched(secret, tmp_path)
    assert not os.path.lexists(folder / ".final.old-123")
    os.symlink(secret.parent, folder / "final")
    tmp = files.fresh_folder(folder, ".final.tmp-")
    (tmp / "a.txt").write_text("new")
    files.sync_tree(tmp)
    files.replace_folder(tmp, folder / "final")
    untouched(secret, tmp_path)
    assert not (folder / "final").is_symlink() and (folder / "final" / "a.txt").read_text() == "new"
    tmp = files.fresh_folder(folder, ".final.tmp-")
    (tmp / "b.txt").write_text("newer")
    files.replace_folder(tmp, folder / "final")
    assert sorted(p.name for p in folder.iterdir()) == ["final"]
    assert sorted(p.name for p in (folder / "final").iterdir()) == ["b.txt"]


def test_inside_refuses_names_that_leave_the_folder(outside):
    secret, folder = outside
    (folder / "shards").mkdir()
    (folder / "shards" / "0.distcp").write_bytes(b"x")
    os.symlink(secret, folder / "shards" / "1.distcp")
    assert files.inside(folder, "shards/0.distcp") == folder / "shards" / "0.distcp"
    for bad in ["shards/../../outside/secret.txt", "/etc/hostname", "shards/1.distcp", "shards//0.distcp",
                "./shards/0.distcp", "", None, 3]:  # fmt: skip
        assert files.inside(folder, bad) is None, bad


FILL = """
import os, resource, signal, sys
from train.core import files
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a failed write (EFBIG), as a full disk fails one
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
log = files.open_append(sys.argv[1])
try:
    for i in range(1000):
        log.write('{"step": %d, "loss": 1.2345678}\\n' % i)
except OSError as err:
    print(err.errno, err.filename)
try:
    files.atomic_write(sys.argv[1] + ".json", b"x" * 5000)
except OSError as err:
    print(err.errno, err.filename)
"""


def test_a_full_disk_keeps_appended_rows_whole_and_leaves_no_temporary(tmp_path):
    """A real write failure: RLIMIT_FSIZE in a child process (EFBIG, with SIGXFSZ ignored)."""
    target = tmp_path / "metrics.jsonl"
    (tmp_path / "metrics.jsonl.json").write_text("old")
    done = subprocess.run([sys.executable, "-c", FILL, str(target), "1000"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"{errno.EFBIG} {target}", f"{errno.EFBIG} {target}.json"]
    text = target.read_text()
    assert text.endswith("\n") and len(text) <= 1000
    rows = [json.loads(line) for line in text.splitlines()]
    assert [r["step"] for r in rows] == list(range(len(rows))) and len(rows) > 20
    assert (tmp_path / "metrics.jsonl.json").read_text() == "old"  # the old file, not half a new one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "metrics.jsonl.json"]



def test_a_stream_stopped_half_way_leaves_the_old_file_and_no_temporary(tmp_path):
    (tmp_path / "tokens.bin").write_bytes(b"old")
    with pytest.raises(KeyboardInterrupt):
        with files.writing(tmp_path / "tokens.bin") as out:
            out.write(b"new" * 1000)
            raise KeyboardInterrupt
    assert (tmp_path / "tokens.bin").read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["tokens.bin"]
    with files.writing(tmp_path / "tokens.bin") as out:
        out.write(b"new")
    assert (tmp_path / "tokens.bin").read_bytes() == b"new"
