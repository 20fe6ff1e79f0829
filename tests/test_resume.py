"""Checkpoints and exact resume on tiny real runs: SIGKILL and SIGTERM at a random step, then
RESUME=1 repeats the uninterrupted run's losses; a truncated checkpoint falls back to the
previous one; a planted pickle never runs; a changed batch size keeps the sample position and
the schedule; NaN losses stop the run with a checkpoint from before them."""

import errno
import json
import math
import os
import random
import shutil
import signal
import subprocess
import threading
import time

import numpy as np
import pytest
import torch
from tiny_tools import one_thread

from conftest import ROOT, read_jsonl, run_cli, train_python
from train.data.stream import BatchStream
from train.data.text import EpochSampler
from train.run.checkpoint import on_disk
from train.run.guard import signals as signals_module

STEPS = 40
RUN = [
    "--batch_size",
    "4",
    "--max_steps",
    str(STEPS),
    "--save_every",
    "3",
    "--keep_checkpoints",
    "20",
    "--seed",
    "7",
]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from one_thread()


@pytest.fixture(scope="module")
def base(corpus, tiny_config, cache_dir, tmp_path_factory):
    runs = tmp_path_factory.mktemp("resume") / "runs"
    flags = [
        "--model_config", str(tiny_config), "--data_path", str(corpus), "--vocab_size", "512",
        "--cache_dir", str(cache_dir), "--output_dir", str(runs), "--max_length", "64", "--log_every", "1",
    ]  # fmt: skip
    return runs, flags


@pytest.fixture(scope="module")
def reference(base):
    """The uninterrupted run every resumed run is compared with."""
    runs, flags = base
    assert run_cli("pretrain", *flags, *RUN, "--run_name", "ref") == 0
    return read_jsonl(runs / "ref" / "metrics.jsonl")


def copy_run(runs, name, keep_up_to=None):
    """A copy of the reference run; keep_up_to drops later checkpoints (a run stopped there)."""
    shutil.copytree(runs / "ref", runs / name, symlinks=True)
    for path in on_disk.list_checkpoints(runs / name / "checkpoints"):
        if keep_up_to is not None and int(path.name.split("-")[1]) > keep_up_to:
            shutil.rmtree(path)
    return runs / name


def summary_of(run):
    return json.loads((run / "summary.json").read_text())


def assert_same_run(rows, reference, resumed_from):
    rows = [r for r in rows if "loss" in r]  # training rows (validation rows carry val_loss)
    reference = [r for r in reference if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # one row per step: none lost or repeated
    assert [r["samples"] for r in rows] == [r["samples"] for r in reference]
    after = [(a["loss"], b["loss"]) for a, b in zip(rows, reference, strict=True) if a["step"] > resumed_from]
    assert len(after) == STEPS - resumed_from > 0
    np.testing.assert_allclose([a for a, _ in after], [b for _, b in after], rtol=0, atol=1e-5)


def start_child(flags, name, *extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    argv = [train_python(), "-m", "train", "pretrain", *flags, *RUN, *extra, "--run_name", name]
    return subprocess.Popen(
        argv,
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


@pytest.fixture(scope="module")
def stopped(base, request):
    """Two real runs in child processes, stopped at a random step each: one by SIGKILL, one by
    SIGTERM to its whole process group (as a scheduler's preemption does; that one has
    DataLoader workers, which must survive it while the step finishes and the save runs)."""
    runs, flags = base
    plan = {
        "killed": (signal.SIGKILL, random.randint(4, STEPS - 16), ()),
        "termed": (signal.SIGTERM, random.randint(4, STEPS - 16), ("--num_workers", "2")),
    }
    procs = {name: start_child(flags, name, *extra) for name, (_, _, extra) in plan.items()}
    request.getfixturevalue("reference")  # trains here while the children import torch
    pending, written, deadline = set(plan), {}, time.monotonic() + 300
    while pending and time.monotonic() < deadline:
        for name in sorted(pending):
            sig, at, _ = plan[name]
            if procs[name].poll() is not None:
                pytest.fail(f"{name} ended (exit {procs[name].returncode}) before step {at}: "
                            f"{procs[name].stderr.read()[-2000:]}")
            metrics = runs / name / "metrics.jsonl"
            if metrics.exists() and len(metrics.read_text().splitlines()) >= at:
                os.killpg(procs[name].pid, sig)
                pending.discard(name)
        time.sleep(0.01)
    results = {}
    for name, proc in procs.items():
        if name in pending:
            proc.kill()
        _, err = proc.communicate(timeout=120)
        written[name] = len((runs / name / "metrics.jsonl").read_text().splitlines())
        results[name] = {"rc": proc.returncode, "err": err, "at": plan[name][1], "rows": written[name]}
    assert not pending, f"no step {[plan[n][1] for n in pending]} within 300 s"
    return results


def test_sigkill_at_a_random_step_then_resume_matches_uninterrupted(base, reference, stopped):
    runs, flags = base
    killed, run = stopped["killed"], runs / "killed"
    assert killed["rc"] == -signal.SIGKILL
    assert not (run / "summary.json").exists()  # killed, not finished

    assert run_cli("pretrain", *flags, *RUN, "--run_name", "killed", "--resume", "1") == 0
    summary = summary_of(run)
    resumed = summary["resumed_from_step"]
    assert 3 <= resumed <= killed["rows"], (killed, resumed)
    assert summary["exit_reason"] == "completed" and summary["steps"] == STEPS
    assert_same_run(read_jsonl(run / "metrics.jsonl"), reference, resumed)
    print(f"SIGKILL at row {killed['at']} ({killed['rows']} rows written): resumed from step {resumed}")


def test_sigterm_saves_at_the_step_and_resume_matches(base, reference, stopped):
    runs, flags = base
    termed, run = stopped["termed"], runs / "termed"
    assert termed["rc"] == 143, termed["err"][-2000:]
    assert "Traceback" not in termed["err"]
    summary = summary_of(run)
    assert summary["exit_reason"] == "interrupted" and summary["stop_signal"] == "SIGTERM"
    at = summary["steps"]
    assert at >= termed["at"] and summary["checkpoint"] == on_disk.checkpoint_name(at)

    assert run_cli("pretrain", *flags, *RUN, "--run_name", "termed", "--resume", "1") == 0
    assert summary_of(run)["resumed_from_step"] == at  # nothing trained was lost
    assert_same_run(read_jsonl(run / "metrics.jsonl"), reference, at)
    print(f"SIGTERM at row {termed['at']}: stopped after step {at}, resumed there")


def test_truncated_newest_checkpoint_falls_back_to_the_previous(base, reference, capsys):
    runs, flags = base
    run = copy_run(runs, "truncated")
    newest = run / "checkpoints" / "step-00000040" / "model.safetensors"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    capsys.readouterr()

    assert (
        run_cli(
            "pretrain", *flags, *RUN, "--run_name", "truncated", "--resume", "1", "--keep_checkpoints", "2"
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "checkpoint step-00000040 cannot be used: model.safetensors is truncated" in out
    assert "step-00000040 cannot be used" in (run / "train.log").read_text()
    assert summary_of(run)["resumed_from_step"] == 39
    assert_same_run(read_jsonl(run / "metrics.jsonl"), reference, 39)
    kept = [p.name for p in on_disk.list_checkpoints(run / "checkpoints")]
    assert kept == ["step-00000040", "step-00000039"]  # KEEP_CHECKPOINTS=2 pruned the rest
    assert (run / "checkpoints" / "step-00000040.invalid").is_dir()  # the bad one, set aside


class Payload:
    """Unpickling this opens (creates) a file: code from the run folder running on load."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_planted_pickle_is_not_executed_on_resume(base, reference, tmp_path, capsys):
    runs, flags = base
    run = copy_run(runs, "pickled")
    marker = tmp_path / "code-ran"
    folder = run / "checkpoints" / "step-00000040"
    torch.save({"optimizer": Payload(marker), "scaler": {}, "rng": {}}, folder / "state.pt")
    meta = json.loads((folder / "meta.json").read_text())  # the checksum matches: only the loader guards
    meta["files"]["state.pt"] = {
        "bytes": (folder / "state.pt").stat().st_size,
        "sha256": on_disk.sha256_of(folder / "state.pt"),
    }
    (folder / "meta.json").write_text(json.dumps(meta))
    torch.save(Payload(marker), folder / "evil.pkl")  # extra files are never read
    capsys.readouterr()

    assert run_cli("pretrain", *flags, *RUN, "--run_name", "pickled", "--resume", "1") == 0
    assert not marker.exists()
    assert "step-00000040 cannot be used: state.pt refused by the safe loader" in capsys.readouterr().out
    assert summary_of(run)["resumed_from_step"] == 39
    # The payload was live: an unsafe load of the same file runs it.
    torch.load(run / "checkpoints" / "step-00000040.invalid" / "state.pt", weights_only=False)
    assert marker.exists()


def test_changed_batch_size_keeps_sample_position_and_schedule(base, reference):
    runs, flags = base
    run = copy_run(runs, "rebatched", keep_up_to=12)
    assert (
        run_cli("pretrain", *flags, *RUN, "--run_name", "rebatched", "--resume", "1", "--batch_size", "8")
        == 0
    )
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]
    summary = summary_of(run)
    assert summary["steps"] == 12 + math.ceil((STEPS * 4 - 48) / 8) and summary["samples"] == STEPS * 4
    # lr by samples seen before the step
    lr_at_samples = {r["samples"] - 4: r["lr"] for r in reference if "lr" in r}
    for row in rows[12:]:
        assert row["lr"] == pytest.approx(lr_at_samples[row["samples"] - 8], rel=1e-12, abs=0)
    final = json.loads(
        (run / "checkpoints" / on_disk.checkpoint_name(summary["steps"]) / "meta.json").read_text()
    )
    assert final["data"]["position"] == STEPS * 4 and final["data"]["epoch"] == 0
    log = (run / "train.log").read_text()
    assert "changed since the checkpoint: BATCH_SIZE 4 -> 8" in log and "effective batch 4 -> 8" in log


def test_resume_of_a_finished_run_touches_nothing(base, reference, capsys):
    """A scheduler's requeue or a repeated command: exit 0, say so, leave every file as it was."""
    runs, flags = base
    run = copy_run(runs, "finished")
    files = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert run_cli("pretrain", *flags, *RUN, "--run_name", "finished", "--resume", "1") == 0
    assert "is complete" in capsys.readouterr().out
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == files


def test_resume_without_run_name_continues_the_newest_run(base, reference):
    runs, flags = base
    old, new = copy_run(runs, "older", keep_up_to=30), copy_run(runs, "newer", keep_up_to=36)
    for path in (old / "checkpoints").iterdir():
        os.utime(path, (time.time() + 3600,) * 2, follow_symlinks=False)  # its checkpoints look newer
    for path in (new / "checkpoints").iterdir():
        os.utime(path, (time.time() + 7200,) * 2, follow_symlinks=False)
    before = (old / "metrics.jsonl").read_text()
    assert run_cli("pretrain", *flags, *RUN, "--resume", "1") == 0
    assert summary_of(new)["resumed_from_step"] == 36 and summary_of(new)["steps"] == STEPS
    assert (old / "metrics.jsonl").read_text() == before


def test_batch_stream_continues_the_permutation_across_batch_sizes():
    def loader_of(sampler, bs):
        return torch.utils.data.DataLoader(list(range(50)), batch_size=bs, sampler=sampler, drop_last=True)

    sampler = EpochSampler(50, seed=3)
    whole = BatchStream(loader_of(sampler, 4), sampler, 4)
    uninterrupted = [int(i) for _ in range(24) for i in next(whole)]  # 96 samples: into epoch 1
    first = BatchStream(loader_of(sampler, 4), sampler, 4)
    seen = [int(i) for _ in range(5) for i in next(first)]  # stop after 20 samples
    second = BatchStream(loader_of(sampler, 8), sampler, 8, first.epoch, first.consumed)
    seen += [int(i) for _ in range(3) for i in next(second)]
    assert seen == uninterrupted[:44]  # none repeated, none skipped
    assert (second.epoch, second.consumed) == (0, 44)
    next(second)  # 44 + 8 > 50: the epoch's remainder is dropped (drop_last), as in the uninterrupted run
    assert (second.epoch, second.consumed) == (1, 8)


@pytest.mark.parametrize("precision, lr", [("fp32", "1e3"), ("fp16", "1e2")])
def test_non_finite_loss_stops_with_a_checkpoint_from_before(precision, lr, tiny_flags, tmp_path):
    argv = [
        *tiny_flags,
        "--batch_size",
        "4",
        "--max_steps",
        "12",
        "--learning_rate",
        lr,
        "--warmup_steps",
        "4",
        "--save_every",
        "2",
        "--nan_patience",
        "3",
        "--precision",
        precision,
        "--run_name",
        "nan",
    ]
    assert run_cli("pretrain", *argv) == 1
    run = tmp_path / "runs" / "nan"
    summary = summary_of(run)
    rows = read_jsonl(run / "metrics.jsonl")
    first_bad = next(r["step"] for r in rows if r["loss"] is None)
    assert summary["exit_reason"] == "non_finite_loss" and summary["non_finite_steps"] == 3
    assert summary["steps"] == first_bad + 2 and not (run / "final").exists()
    saved = on_disk.list_checkpoints(run / "checkpoints")
    assert all(int(p.name.split("-")[1]) < first_bad for p in saved)
    if precision == "fp16":  # each skipped step halved the GradScaler's scale (from 65536)
        assert summary["skipped_steps"] >= 1
        assert summary["loss_scale"] == 65536 / 2 ** summary["skipped_steps"]


@pytest.mark.parametrize("failure", ["precheck", "enospc"])
def test_disk_full_keeps_the_previous_checkpoint(failure, tiny_flags, tmp_path, monkeypatch, capsys):
    real_save, calls = torch.save, []

    def full_disk_save(obj, path, *args, **kwargs):  # a disk that fills during the second save
        calls.append(path)
        if len(calls) == 1:
            return real_save(obj, path, *args, **kwargs)
        path.write(b"\0" * 100)  # the kit hands torch.save a handle of its own
        raise OSError(errno.ENOSPC, "No space left on device")

    if failure == "enospc":
        monkeypatch.setattr(on_disk.torch, "save", full_disk_save)
    else:
        frees = iter([10**12])
        monkeypatch.setattr(on_disk.CheckpointFolder, "free_bytes", lambda self: next(frees, 4096))
    argv = [*tiny_flags, "--batch_size", "4", "--max_steps", "6", "--save_every", "2", "--run_name", "full"]
    assert run_cli("pretrain", *argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err
    if failure == "enospc":  # part-way: the file that did not fit is named
        assert "disk full: writing checkpoint step-00000004 failed at state.pt" in errors[0]
    else:
        assert "disk full: checkpoint step-00000004 needs about" in errors[0] and "MiB" in errors[0]
    assert "step-00000002 is intact" in errors[0] and "RESUME=1 RUN_NAME=full continues the run" in errors[0]
    folder = tmp_path / "runs" / "full" / "checkpoints"
    assert [p.name for p in on_disk.list_checkpoints(folder)] == ["step-00000002"]
    assert not list(folder.glob(".tmp-*"))


def test_ctrl_c_finishes_the_step_saves_and_exits_130(tiny_flags, tmp_path):
    run = tmp_path / "runs" / "ctrl_c"

    def press_ctrl_c():  # as the terminal does, once training is under way
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            metrics = run / "metrics.jsonl"
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.01)

    presser = threading.Thread(target=press_ctrl_c, daemon=True)
    presser.start()
    argv = [
        *tiny_flags,
        "--batch_size",
        "4",
        "--max_steps",
        "1000",
        "--save_every",
        "500",
        "--run_name",
        "ctrl_c",
    ]
    assert run_cli("pretrain", *argv) == 130
    presser.join()
    summary = summary_of(run)
    assert summary["exit_reason"] == "interrupted" and summary["stop_signal"] == "SIGINT"
    assert 3 <= summary["steps"] < 1000 and summary["checkpoint"] == on_disk.checkpoint_name(summary["steps"])
    # the step in progress finished and logged
    assert len(read_jsonl(run / "metrics.jsonl")) == summary["steps"]
    assert (run / "final" / "model.safetensors").exists()


def test_second_signal_quits_at_once(monkeypatch):
    def fake_exit(code):  # os._exit would end the test process itself
        raise SystemExit(code)

    monkeypatch.setattr(signals_module.os, "_exit", fake_exit)
    before = signal.getsignal(signal.SIGINT)
    signals = signals_module.StopSignals()
    signals.install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert signals.received == signal.SIGINT  # the first only asks the loop to stop
        with pytest.raises(SystemExit) as stop:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        assert stop.value.code == 130
    finally:
        signals.restore()
    assert signal.getsignal(signal.SIGINT) is before
