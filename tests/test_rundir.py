"""The run folder's life on tiny real runs: a NaN validation loss stops like NaN training losses;
final/ and best/ are written whole (a full disk mid-save keeps the old one and ends in one line,
and RESUME=1 then finishes the run instead of calling it complete); run names are claimed
atomically and a folder in use is refused; an OUTPUT_DIR that cannot be made is one line."""

import errno
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import threading
import time

import pytest
import transformers
from tiny_tools import one_thread

from conftest import ROOT, forking, read_jsonl, run_cli, train_python
from train.run.checkpoint.on_disk import list_checkpoints
from train.run.rundir import claim as claims_module
from train.run.rundir import folder

FAST = ["--batch_size", "4", "--seed", "3"]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from one_thread()


def one_error(capsys) -> tuple[str, str]:
    """(the one error line, stdout); fails on a traceback or a second error line."""
    out, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, err[-3000:]
    return errors[0], out


def summary(run):
    return json.loads((run / "summary.json").read_text())


def files_of(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def fail_final_save(monkeypatch, folder_name="final", after=0):
    """save_pretrained into <folder_name>'s temporary folder raises ENOSPC (after `after` good
    saves), having written part of a file first, as a disk that fills mid-save does."""
    real, calls = transformers.PreTrainedModel.save_pretrained, []

    def save_pretrained(self, path, *args, **kwargs):
        if os.path.basename(str(path)).startswith(f".{folder_name}.tmp"):
            calls.append(path)
            if len(calls) > after:
                os.makedirs(path, exist_ok=True)
                with open(os.path.join(path, "model.safetensors"), "wb") as handle:
                    handle.write(b"\0" * 1000)
                raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, path, *args, **kwargs)

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", save_pretrained)
    return calls


# ---- a NaN validation loss ----------------------------------------------------------------------


def test_nan_validation_loss_is_a_clean_non_finite_stop(tiny_flags, tmp_path, capsys):
    """LEARNING_RATE=1e9 MAX_STEPS=1: the step's training loss is finite (it is measured before
    the update) but the weights after it are not, so only validation sees it."""
    argv = [*tiny_flags, *FAST, "--max_steps", "1", "--learning_rate", "1e9", "--run_name", "nan"]
    assert run_cli("pretrain", *argv) == 1  # the exit code of the NAN_PATIENCE stop
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "error:" not in err
    run = tmp_path / "runs" / "nan"
    s = summary(run)
    assert (
        s["exit_reason"] == "non_finite_loss" and s["final_val_loss"] is None and s["best_val_loss"] is None
    )
    assert "validation loss is nan at step 1" in s["stop_detail"] and "no checkpoint yet" in s["stop_detail"]
    assert "eval step 1: val_loss nan val_ppl n/a" in out and "stopping: validation loss is nan" in out
    assert not (run / "final").exists() and not list_checkpoints(run / "checkpoints")
    outputs = next(line for line in out.splitlines() if line.startswith("outputs:"))
    assert "summary.json" in outputs and "final/" not in outputs  # only what was written


def test_nan_patience_zero_keeps_training_through_a_nan_validation_loss(tiny_flags, tmp_path, capsys):
    argv = [
        *tiny_flags,
        *FAST,
        "--max_steps",
        "1",
        "--learning_rate",
        "1e9",
        "--nan_patience",
        "0",
        "--run_name",
        "on",
    ]
    assert run_cli("pretrain", *argv) == 0  # NAN_PATIENCE=0: the user asked for no stop
    assert "val_ppl n/a" in capsys.readouterr().out
    assert summary(tmp_path / "runs" / "on")["exit_reason"] == "completed"


# ---- final/ and best/: whole or not at all ---------------------------------------------------


def test_disk_full_writing_final_then_resume_finishes_the_run(tiny_flags, tmp_path, monkeypatch, capsys):
    argv = [*tiny_flags, *FAST, "--max_steps", "4", "--save_every", "2", "--run_name", "full"]
    calls = fail_final_save(monkeypatch)
    assert run_cli("pretrain", *argv) == 2
    line, _ = one_error(capsys)
    run = tmp_path / "runs" / "full"
    assert calls and line.startswith(f"error: disk full: writing {run / 'final'} failed (No space left on "
                                     f"device)")
    assert "checkpoint step-00000004 is intact" in line
    assert line.endswith("free space, then RESUME=1 RUN_NAME=full writes final/ and summary.json")
    assert not (run / "final").exists() and not list(run.glob(".final.*"))  # no half folder left
    first = summary(run)
    assert first["steps"] == 4 and first["samples_per_sec"] > 0 and "disk full" in first["final_error"]
    monkeypatch.undo()

    # The run is trained to its end, but not finished: RESUME=1 writes final/ and summary.json.
    assert run_cli("pretrain", *argv, "--resume", "1") == 0
    out = capsys.readouterr().out
    assert "is trained to the end but its summary.json records no finished run" in out
    assert json.loads((run / "final" / folder.COMPLETE).read_text()) == {"step": 4}
    assert (run / "final" / "model.safetensors").stat().st_size > 100_000
    second = summary(run)
    assert "final_error" not in second
    assert second["samples_per_sec"] == first["samples_per_sec"]  # the training session's figures kept
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r] == [1, 2, 3, 4]

    # Now it is complete: a third RESUME=1 changes nothing.
    before = files_of(run)
    assert run_cli("pretrain", *argv, "--resume", "1") == 0
    assert "is complete" in capsys.readouterr().out
    assert files_of(run) == before


def test_a_full_disk_keeps_the_previous_final_and_resume_replaces_it(
    tiny_flags, tmp_path, monkeypatch, capsys
):
    """The real write path: safetensors (Rust) hits a file-size limit (EFBIG, as a full disk
    gives ENOSPC) while writing the weights of a longer run; the first final/ stays whole."""
    argv = [*tiny_flags, *FAST, "--save_every", "2", "--run_name", "grow"]
    assert run_cli("pretrain", *argv, "--max_steps", "2") == 0
    run = tmp_path / "runs" / "grow"
    old_final = files_of(run / "final")
    real = transformers.PreTrainedModel.save_pretrained

    def limited(self, *args, **kwargs):
        limits = resource.getrlimit(resource.RLIMIT_FSIZE)
        old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a failed write, not a killed process
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, limits[1]))
        try:
            return real(self, *args, **kwargs)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, limits)
            signal.signal(signal.SIGXFSZ, old_handler)

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", limited)
    capsys.readouterr()
    assert run_cli("pretrain", *argv, "--max_steps", "4", "--resume", "1") == 2
    line, _ = one_error(capsys)
    assert line.startswith(f"error: disk full: writing {run / 'final'} failed (File too large)")
    assert files_of(run / "final") == old_final and not list(run.glob(".final.*"))
    monkeypatch.undo()

    assert run_cli("pretrain", *argv, "--max_steps", "4", "--resume", "1") == 0
    assert "is trained to the end but" in capsys.readouterr().out
    assert json.loads((run / "final" / folder.COMPLETE).read_text()) == {"step": 4}
    assert summary(run)["steps"] == 4 and "final_error" not in summary(run)


def test_resume_rewrites_a_final_without_its_marker(tiny_flags, tmp_path, capsys):
    """A final/ cut short (an older kit's direct save, killed half-way) is not a finished run."""
    argv = [*tiny_flags, *FAST, "--max_steps", "2", "--run_name", "cut"]
    assert run_cli("pretrain", *argv) == 0
    run = tmp_path / "runs" / "cut"
    (run / "final" / folder.COMPLETE).unlink()
    (run / "final" / "model.safetensors").write_bytes(b"\0" * 10)
    assert run_cli("pretrain", *argv, "--resume", "1") == 0
    assert "its final/ is missing or incomplete" in capsys.readouterr().out
    assert (run / "final" / "model.safetensors").stat().st_size > 100_000
    transformers.AutoModelForCausalLM.from_pretrained(run / "final", local_files_only=True)


def test_disk_full_writing_best_keeps_the_previous_best(tiny_flags, tmp_path, monkeypatch, capsys):
    argv = [
        *tiny_flags,
        *FAST,
        "--max_steps",
        "6",
        "--save_every",
        "2",
        "--eval_every",
        "2",
        "--keep_best",
        "1",
        "--run_name",
        "best",
    ]
    fail_final_save(monkeypatch, "best", after=1)  # the first best/ (step 2) is written, the next fails
    assert run_cli("pretrain", *argv) == 2
    line, _ = one_error(capsys)
    run = tmp_path / "runs" / "best"
    assert line.startswith(f"error: disk full: writing {run / 'best'} failed")
    assert (
        "is intact and so is the previous best/" in line
        and "RESUME=1 RUN_NAME=best continues the run" in line
    )
    assert json.loads((run / "best" / folder.COMPLETE).read_text()) == {"step": 2}
    assert not list(run.glob(".best.*"))


# ---- claiming the folder ----------------------------------------------------------------------


def test_runs_started_in_the_same_second_get_different_folders(tmp_path, monkeypatch):
    monkeypatch.setattr(claims_module, "_default_name", lambda launcher: f"{launcher}-20250101-000000")
    start, claims, errors = threading.Barrier(8), [], []

    def claim():
        start.wait()
        try:
            claims.append(claims_module.claim_run_dir(str(tmp_path / "runs"), None, "pretrain", False))
        except Exception as err:  # noqa: BLE001 - any error is the failure this test looks for
            errors.append(err)

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    names = sorted(c.path.name for c in claims)
    assert names == sorted(
        ["pretrain-20250101-000000", *(f"pretrain-20250101-000000-{n}" for n in range(2, 9))]
    )
    for c in claims:
        c.release()  # each folder was still empty: removed again (OUTPUT_DIR too, which a claim made)
    assert not (tmp_path / "runs").exists() or list((tmp_path / "runs").iterdir()) == []


def test_two_real_runs_in_one_second_both_finish(tiny_flags, tmp_path, monkeypatch):
    monkeypatch.setattr(claims_module, "_default_name", lambda launcher: f"{launcher}-20250101-000000")
    for _ in range(2):
        assert run_cli("pretrain", *tiny_flags, *FAST, "--max_steps", "1") == 0
    runs = tmp_path / "runs"
    launcher = summary(runs / "latest")["run_name"].rsplit("-", 1)[0]
    for name in (launcher, f"{launcher}-2"):
        assert (runs / name / "final" / folder.COMPLETE).exists()


def test_bad_input_after_the_claim_leaves_nothing(tiny_flags, tmp_path, capsys):
    """The folder (and a missing OUTPUT_DIR) is made before the build; bad input found by the
    build removes them again."""
    out = tmp_path / "new" / "deeper" / "runs"
    argv = [
        *tiny_flags,
        *FAST,
        "--max_steps",
        "1",
        "--output_dir",
        str(out),
        "--data_path",
        str(tmp_path / "none.txt"),
    ]
    assert run_cli("pretrain", *argv) == 2
    assert "DATA_PATH" in one_error(capsys)[0]
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("where", ["under_a_file", "a_file", "proc"])
def test_output_dir_that_cannot_be_made_is_one_line(where, tiny_flags, tmp_path, capsys):
    blocker = tmp_path / "blocker"
    blocker.write_text("a regular file\n")
    output = {"under_a_file": blocker / "runs", "a_file": blocker, "proc": "/proc/no-such-kit-runs"}[where]
    assert run_cli("pretrain", *tiny_flags, *FAST, "--max_steps", "1", "--output_dir", str(output)) == 2
    line, _ = one_error(capsys)
    assert line.startswith(f"error: OUTPUT_DIR (--output_dir): cannot create {output}")
    assert blocker.read_text() == "a regular file\n" and sorted(tmp_path.iterdir()) == [blocker]


def start_run(flags, name, *extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    argv = [train_python(), "-m", "train", "pretrain", *flags, *FAST, *extra, "--run_name", name]
    return subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )


def wait_for(predicate, proc, what, limit=240):
    deadline = time.monotonic() + limit
    while not predicate():
        if proc.poll() is not None:
            pytest.fail(f"the run ended (exit {proc.returncode}) before {what}: {proc.stderr.read()[-2000:]}")
        assert time.monotonic() < deadline, f"no {what} within {limit} s"
        time.sleep(0.05)


def test_a_folder_in_use_is_refused_and_freed_when_its_run_dies(tiny_flags, tmp_path, capsys):
    run = tmp_path / "runs" / "busy"
    proc = start_run(tiny_flags, "busy", "--max_steps", "100000", "--save_every", "5", "--log_every", "1")
    try:
        wait_for(lambda: list_checkpoints(run / "checkpoints"), proc, "a checkpoint")
        config = (run / "config.json").read_bytes()
        for extra in (["--overwrite", "1"], ["--resume", "1"], []):
            assert (
                run_cli("pretrain", *tiny_flags, *FAST, "--max_steps", "3", "--run_name", "busy", *extra) == 2
            )
            line, _ = one_error(capsys)
            # the run's process: proc, or the fork server's child for it
            holder = int(re.search(r"\(pid (\d+)\)", line)[1])
            assert line == (
                f"error: RUN_NAME=busy: {run} is in use by another run (pid {holder}); "
                "wait for it or pick another RUN_NAME"
            )
            assert holder == proc.pid or forking()
            os.kill(holder, 0)  # alive
        assert proc.poll() is None and (run / "config.json").read_bytes() == config  # not overwritten
        steps = [r["step"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]
        assert steps == list(range(1, len(steps) + 1))  # one run's rows, none mixed in
    finally:
        proc.kill()  # SIGKILL: no cleanup of its own; the OS drops the lock
        proc.communicate(timeout=60)
    newest = int(list_checkpoints(run / "checkpoints")[0].name.split("-")[1])
    resumed = ["--max_steps", str(newest + 2), "--save_every", "5", "--run_name", "busy", "--resume", "1"]
    assert run_cli("pretrain", *tiny_flags, *FAST, *resumed) == 0
    assert summary(run)["steps"] == newest + 2 and (run / "final" / folder.COMPLETE).exists()


def test_holder_pid_reads_proc_locks(tmp_path):
    import fcntl

    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert claims_module.holder_pid(tmp_path) == str(os.getpid())
    finally:
        os.close(fd)
    assert claims_module.holder_pid(tmp_path) == "unknown"


def test_two_processes_claim_once_save_best_and_resume_writes_a_missing_final(
    corpus, tiny_config, cache_dir, tmp_path
):
    """Under torchrun rank 0 alone claims and writes the folder; best/ and final/ are saved by
    rank 0 with every rank agreeing; RESUME=1 of a run without final/ writes it on 2 ranks."""
    from conftest import launch

    runs = tmp_path / "runs"
    env = {
        "MODEL_CONFIG": str(tiny_config),
        "DATA_PATH": str(corpus),
        "VOCAB_SIZE": "512",
        "CACHE_DIR": str(cache_dir),
        "OUTPUT_DIR": str(runs),
        "MAX_LENGTH": "64",
        "BATCH_SIZE": "4",
        "MAX_STEPS": "2",
        "EVAL_EVERY": "1",
        "KEEP_BEST": "1",
        "RUN_NAME": "two",
        "NPROC_PER_NODE": "2",
        "OMP_NUM_THREADS": "1",
    }
    first = launch("run_single_gpu.sh", env)
    assert first.returncode == 0, first.stderr[-3000:]
    run = runs / "two"
    assert sorted(p.name for p in runs.iterdir()) == ["latest", "two"]
    assert json.loads((run / "final" / folder.COMPLETE).read_text()) == {"step": 2}
    assert (run / "best" / folder.COMPLETE).exists()
    shutil.rmtree(run / "final")
    again = launch("run_single_gpu.sh", {**env, "RESUME": "1"})
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("is trained to the end but its final/ is missing or incomplete") == 1
    assert json.loads((run / "final" / folder.COMPLETE).read_text()) == {"step": 2}
