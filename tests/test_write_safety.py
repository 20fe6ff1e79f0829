"""A run folder and CACHE_DIR under attack or out of space, on tiny real runs: links planted at
the kit's names (temporary ones included) are never written or read through, and the file
outside stays as it was; a full disk while appending metrics.jsonl or saving the trained
tokenizer is one line naming the file, with whole rows and summary.json where it fits; RESUME=1
of a live run before its first save names that run."""

import contextlib
import fcntl
import json
import os
import resource
import shutil
import signal

import pytest
from tiny_tools import one_thread

from conftest import read_jsonl, run_cli
from train.run.checkpoint.on_disk import list_checkpoints

FAST = ["--batch_size", "4", "--seed", "3", "--log_every", "1", "--save_every", "2"]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from one_thread()


@pytest.fixture(scope="module")
def finished(corpus, tiny_config, cache_dir, tmp_path_factory):
    """A finished 2-step run with a checkpoint at step 2, and the flags that made it."""
    runs = tmp_path_factory.mktemp("safety") / "runs"
    flags = [
        "--model_config",
        str(tiny_config),
        "--data_path",
        str(corpus),
        "--vocab_size",
        "512",
        "--cache_dir",
        str(cache_dir),
        "--output_dir",
        str(runs),
        "--max_length",
        "64",
        *FAST,
    ]
    assert run_cli("pretrain", *flags, "--max_steps", "2", "--run_name", "done") == 0
    return runs, flags


def copy_run(finished, name):
    runs, flags = finished
    shutil.copytree(runs / "done", runs / name, symlinks=True)
    return runs / name, [*flags, "--run_name", name]


@pytest.fixture
def secret(tmp_path):
    """A folder outside the run folder with one file in it; checked unchanged at the end."""
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "secret.txt").write_text("do not touch\n")
    yield folder / "secret.txt"
    assert (folder / "secret.txt").read_text() == "do not touch\n"
    assert sorted(p.name for p in folder.iterdir()) == ["secret.txt"]  # nothing written outside


def one_error(capsys) -> str:
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, err[-3000:]
    return errors[0]


def test_resume_never_writes_through_links_planted_at_temporary_names(finished, secret, capsys):
    """RESUME=1 of a run without its final/: it writes final/, summary.json and config.json
    while links wait at the temporary names older kits used and summary.json is a link."""
    run, flags = copy_run(finished, "planted")
    shutil.rmtree(run / "final")
    (run / "summary.json").unlink()
    pid = os.getpid()  # run_cli trains in this process: these are the names it would have used
    for name in (".summary.json.tmp", ".config.json.tmp", f".final.tmp-{pid}"):
        os.symlink(secret, run / name)
    for name in (
        f".final.old-{pid}",
        f"checkpoints/.tmp-step-00000002-{pid}",
        f"checkpoints/.old-step-00000002-{pid}",
    ):
        os.symlink(secret.parent, run / name)  # a folder outside: a tree removal there would empty it
    os.symlink(secret, run / "summary.json")
    assert run_cli("pretrain", *flags, "--max_steps", "2", "--resume", "1") == 0
    assert "is trained to the end but its summary.json is missing or unreadable" in capsys.readouterr().out
    summary = json.loads((run / "summary.json").read_text())
    assert not (run / "summary.json").is_symlink() and summary["steps"] == 2
    assert (run / "final" / ".complete").is_file() and not (run / "final").is_symlink()
    # The kit's own leftover names are unlinked, never followed; the others are left alone.
    for name in (f".final.old-{pid}", f".final.tmp-{pid}", f"checkpoints/.tmp-step-00000002-{pid}"):
        assert not os.path.lexists(run / name), name
    assert (run / ".summary.json.tmp").is_symlink()


@pytest.mark.parametrize("name", ["metrics.jsonl", "train.log"])
def test_resume_refuses_an_append_file_that_is_a_link(name, finished, secret, capsys):
    run, flags = copy_run(finished, f"link-{name}")
    (run / name).unlink()
    os.symlink(secret, run / name)
    assert run_cli("pretrain", *flags, "--max_steps", "4", "--resume", "1") == 2
    line = one_error(capsys)
    assert line.startswith(f"error: {run / name} is a symbolic link; the kit never writes or reads through a "
                           f"link")
    assert (run / name).is_symlink()


def test_checkpoint_folders_that_are_links_are_not_checkpoints(finished, secret, capsys):
    """A step folder linked to a folder elsewhere is never listed (so never loaded or pruned);
    checkpoints/ itself a link is refused in one line."""
    run, flags = copy_run(finished, "linked-step")
    os.symlink(run / "checkpoints" / "step-00000002", run / "checkpoints" / "step-00000009")
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["step-00000002"]
    elsewhere = secret.parent.parent / "elsewhere"
    (run / "checkpoints").rename(elsewhere)
    os.symlink(elsewhere, run / "checkpoints")
    assert run_cli("pretrain", *flags, "--max_steps", "4", "--resume", "1") == 2
    assert one_error(capsys) == (
        f"error: {run / 'checkpoints'} is a symbolic link; the kit never writes or reads through a link in "
        f"its own folders (remove it and run again)"
    )


@contextlib.contextmanager
def file_size_limit(limit: int):
    """Writes past `limit` bytes fail with EFBIG in this process, as a full disk fails them with
    ENOSPC (SIGXFSZ ignored: a failed write, not a killed process)."""
    before = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, before[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, before)
        signal.signal(signal.SIGXFSZ, handler)


def test_full_disk_while_appending_metrics_keeps_whole_rows_and_says_resume(finished, capsys):
    """metrics.jsonl grown near a file-size limit (rows of step 0 that RESUME=1 keeps), then a
    resumed run appends until a row no longer fits: one line naming the file, no cut row,
    summary.json written, and RESUME=1 (named in the line) continues the run."""
    run, flags = copy_run(finished, "full")
    pad = json.dumps({"step": 0, "pad": "x" * 1000}) + "\n"
    with open(run / "metrics.jsonl", "a") as handle:
        handle.write(pad * 3000)  # 3 MB: more than a checkpoint of the tiny model
    size = (run / "metrics.jsonl").stat().st_size
    with file_size_limit(size + 500):  # room for one row of the resumed run, not two
        code = run_cli("pretrain", *flags, "--max_steps", "8", "--resume", "1")
    line = one_error(capsys)
    assert code == 2
    assert line == (
        f"error: disk full: appending to {run / 'metrics.jsonl'} failed (File too large); its rows are "
        f"whole; "
        "checkpoint step-00000002 is intact; free space, then RESUME=1 RUN_NAME=full continues the run"
    )
    text = (run / "metrics.jsonl").read_text()
    assert text.endswith("\n") and all(json.loads(row) for row in text.splitlines())
    summary = json.loads((run / "summary.json").read_text())
    assert summary["exit_reason"] == "write_failed" and summary["write_error"] == line.removeprefix("error: ")
    assert summary["steps"] == 4 and not list(run.glob(".*.tmp"))

    assert run_cli("pretrain", *flags, "--max_steps", "8", "--resume", "1") == 0
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r] == list(range(1, 9))
    assert json.loads((run / "summary.json").read_text())["exit_reason"] == "completed"


def test_full_disk_while_saving_the_trained_tokenizer_is_one_line(
    finished, corpus, tiny_config, tmp_path, capsys
):
    """tokenizers (Rust) reports the failed write as a plain Exception ("... (os error 27)")."""
    cache = tmp_path / "cache"
    runs, flags = finished
    argv = [*flags, "--cache_dir", str(cache), "--output_dir", str(tmp_path / "runs"), "--max_steps", "1"]
    with file_size_limit(5000):
        assert run_cli("pretrain", *argv) == 2
    line = one_error(capsys)
    assert line.startswith(f"error: CACHE_DIR: cannot write the tokenizer {cache / 'tokenizers'}/bpe-512-")
    assert line.endswith(": File too large")
    assert list((cache / "tokenizers").iterdir()) == [] and not (tmp_path / "runs").exists()


def test_resume_of_a_live_run_before_its_first_save_names_the_run(finished, capsys):
    """A run that holds its folder (its flock) and has saved nothing yet: in use, not "no
    checkpoint"."""
    runs, flags = finished
    run = runs / "live"
    run.mkdir()
    holder = os.open(run, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)
        assert run_cli("pretrain", *flags, "--run_name", "live", "--resume", "1") == 2
        assert one_error(capsys) == (
            f"error: RUN_NAME=live: {run} is in use by another run (pid {os.getpid()}); wait for it or pick "
            "another RUN_NAME"
        )
    finally:
        os.close(holder)
    assert run_cli("pretrain", *flags, "--run_name", "live", "--resume", "1") == 2
    assert "has no checkpoint (it stopped before its first save" in one_error(capsys)


def test_links_at_cache_names_are_removed_and_the_cache_built_again(corpus, cache_dir, tmp_path, secret):
    """A tokenizer folder and a token cache linked to copies elsewhere (which would load fine
    if followed): noted, unlinked, built again in CACHE_DIR; the copies are not read or changed."""
    from train.data import text as data

    sources = data.corpus_files(str(corpus))
    key = data.corpus_fingerprint(sources)
    name = f"bpe-512-{key}"
    good = data.load_tokenizer(None, sources, key, 512, cache_dir, print)
    cache = tmp_path / "cache"
    (cache / "tokenizers").mkdir(parents=True)
    elsewhere = secret.parent.parent / "elsewhere"
    shutil.copytree(cache_dir / "tokenizers" / name, elsewhere / name)
    os.symlink(elsewhere / name, cache / "tokenizers" / name)
    notes = []
    tok = data.load_tokenizer(None, sources, key, 512, cache, notes.append)
    assert f"{cache / 'tokenizers' / name} in CACHE_DIR is a symbolic link" in notes[0]
    assert (cache / "tokenizers" / name / "tokenizer.json").is_file()
    assert not (cache / "tokenizers" / name).is_symlink() and tok.get_vocab() == good.get_vocab()

    tokens = data.token_cache(sources, key, tok, cache_dir, print)  # the shared cache's files
    shared = cache_dir / "tokens" / f"{key}-{data.tokenizer_fingerprint(tok)}"
    (cache / "tokens" / shared.name).mkdir(parents=True)
    for name in ("shard-00000.bin", "manifest.json"):
        shutil.copyfile(shared / name, elsewhere / f"copy-{name}")
        os.symlink(elsewhere / f"copy-{name}", cache / "tokens" / shared.name / name)
    before = {p.name: p.read_bytes() for p in elsewhere.glob("copy-*")}
    again = data.token_cache(sources, key, tok, cache, notes.append)
    assert any("is a symbolic link" in note and note.endswith(".bin in CACHE_DIR is a symbolic link, not a "
                                                              "cache "
                                                              "this kit wrote; removed, building it again")
               for note in notes)  # fmt: skip
    assert (again == tokens).all() and not any(p.is_symlink() for p in (cache / "tokens").rglob("*"))
    assert {p.name: p.read_bytes() for p in elsewhere.glob("copy-*")} == before


@pytest.mark.parametrize("extra", [["--overwrite", "1"], ["--resume", "1"]])
def test_a_run_name_that_is_a_link_is_refused(extra, finished, secret, capsys):
    """OVERWRITE=1 through a link would empty the folder it points to."""
    runs, flags = finished
    link = runs / f"link-{extra[0].strip('-')}"
    os.symlink(secret.parent, link)
    assert run_cli("pretrain", *flags, "--run_name", link.name, "--max_steps", "2", *extra) == 2
    assert one_error(capsys) == (
        f"error: RUN_NAME={link.name}: {link} is a symbolic link; a run folder is never used through one "
        "(set RUN_NAME to the folder it points to)"
    )
