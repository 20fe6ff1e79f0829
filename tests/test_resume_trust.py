"""RESUME=1 repeats the run it continues (Round 5, "reliability and truth"):
- the settings come from the run as the kit sealed them: a config.json edited by hand (CACHE_DIR,
  DATA_PATH, MODEL_CONFIG) is refused in one line, exit 2, nothing written; one deleted is replaced
  by the checkpoint's copy;
- `RESUME=1 RUN_NAME=x ./train_dpo.sh` (carry.py's form) after a SIGKILL of `./train_dpo.sh 2` trains
  micro-batch 2, not the launcher's default 8, and the uninterrupted run's losses; a MAX_STEPS given on
  resume ends the run at that step, one below the checkpoint is refused;
- an interrupted run's "done:" line and final_loss are the last step's loss, not the last logged one;
- an interrupted `make compare` says a command that works, and `make compare RESUME=1` continues it."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from test_dpo_mode import sft_and_pairs

from conftest import ROOT, launcher_env, read_jsonl, run_cli, train_python


def losses(run: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]


def signal_when(proc: subprocess.Popen, ready, sig: int) -> None:
    """Send sig to proc's process group once ready() is true."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if ready():
            os.killpg(proc.pid, sig)
            return
        time.sleep(0.01)
    pytest.fail(f"the run ended (exit {proc.poll()}) before it was due a signal")


def kill_when(proc: subprocess.Popen, metrics: Path, rows: int, sig: int) -> None:
    """Send sig to proc's process group once metrics.jsonl holds `rows` rows."""
    signal_when(proc, lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= rows, sig)


# ---- config.json is not the run's settings unless the kit wrote it ---------------------------------


@pytest.fixture
def finished(tiny_flags, tmp_path) -> tuple[list[str], Path]:
    """A 2-step pretraining run with a checkpoint at each step; the flags that find it again."""
    assert run_cli("pretrain", *tiny_flags, "--max_steps", "2", "--save_every", "1", "--run_name", "r") == 0
    return ["--output_dir", str(tmp_path / "runs"), "--run_name", "r", "--resume", "1", "--max_steps", "4"], \
        tmp_path / "runs" / "r"  # fmt: skip


@pytest.mark.parametrize(
    "section, field, variable",
    [
        ("data", "cache_dir", "CACHE_DIR"),
        ("data", "data_path", "DATA_PATH"),
        ("model", "model_config", "MODEL_CONFIG"),
    ],
)
def test_an_edited_config_json_is_refused_in_one_line(finished, tmp_path, capsys, section, field, variable):
    resume, run = finished
    record = json.loads((run / "config.json").read_text())
    elsewhere = tmp_path / "elsewhere"
    other = tmp_path / "other.txt"
    other.write_text("other words " * 200)
    record["asked"][section][field] = str({"cache_dir": elsewhere, "data_path": other}.get(field, other))
    (run / "config.json").write_text(json.dumps(record, indent=2))
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert run_cli("pretrain", *resume) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert f"RESUME=1: {run / 'config.json'} was edited after the run wrote it ({variable} differ" in err[0]
    assert "checkpoint step-00000002's" in err[0]
    assert not elsewhere.exists()  # nothing written where the edit pointed
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before  # the run folder untouched


def test_config_json_as_the_kit_wrote_it_or_gone_resumes(finished, capsys):
    resume, run = finished
    assert run_cli("pretrain", *resume) == 0  # as written: the seal holds
    assert [s for s, _ in losses(run)] == [1, 2, 3, 4]
    record = json.loads((run / "config.json").read_text())
    assert record["asked"]["optim"]["max_steps"] == 4  # the resumed session's own, sealed again
    (run / "config.json").unlink()
    capsys.readouterr()
    assert run_cli("pretrain", *resume[:-2], "--max_steps", "5") == 0
    out = capsys.readouterr().out
    assert "config.json is missing or unreadable: its settings are checkpoint step-00000004's copy" in out
    assert [s for s, _ in losses(run)] == [1, 2, 3, 4, 5]


# ---- the launcher's defaults are not the user's settings on resume ---------------------------------


@pytest.fixture(scope="module")
def dpo_root(base_model, tmp_path_factory) -> Path:
    """A tiny SFT run (the DPO model) and preference pairs."""
    return sft_and_pairs(base_model, tmp_path_factory.mktemp("resume-trust"), "sft", 16)


def dpo_env(root: Path, **more: str) -> dict:
    return launcher_env(
        {
            "MODEL_PATH": str(root / "sft" / "sft" / "final"),
            "DATA_PATH": str(root / "pairs.jsonl"),
            "OUTPUT_DIR": str(root / "runs"),
            "CACHE_DIR": str(root / "cache"),
            "MAX_LENGTH": "64",
            "NUM_WORKERS": "0",
            "REFERENCE": "copy",
            "LEARNING_RATE": "1e-3",
            "OMP_NUM_THREADS": "1",
            **more,
        }
    )


def dpo_launch(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(ROOT / "train_dpo.sh"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )


def test_sigkill_then_the_documented_resume_repeats_the_run(dpo_root):
    runs = dpo_root / "runs"
    first = {"MAX_STEPS": "6", "SAVE_EVERY": "2", "LOG_EVERY": "1"}
    whole = dpo_launch(dpo_env(dpo_root, RUN_NAME="whole", **first), "2")
    assert whole.returncode == 0, whole.stderr[-2000:]
    proc = subprocess.Popen(
        ["bash", str(ROOT / "train_dpo.sh"), "2"],
        env=dpo_env(dpo_root, RUN_NAME="x", **first),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    kill_when(proc, runs / "x" / "metrics.jsonl", 3, signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL and not (runs / "x" / "summary.json").exists()

    # carry.py's form: no micro-batch argument, no MAX_STEPS (the launcher's BATCH_SIZE=${BATCH_SIZE:-8} was
    # 8)
    resumed = dpo_launch(dpo_env(dpo_root, RESUME="1", RUN_NAME="x"))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    summary = json.loads((runs / "x" / "summary.json").read_text())
    assert summary["batch_size"] == 2 and summary["steps"] == 6 and summary["resumed_from_step"] in (2, 4)
    assert "done: 6 steps" in resumed.stdout
    got, want = losses(runs / "x"), losses(runs / "whole")
    assert [s for s, _ in got] == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose([v for _, v in got], [v for _, v in want], rtol=0, atol=1e-5)

    # a MAX_STEPS given on resume is the step the run ends at
    longer = dpo_launch(dpo_env(dpo_root, RESUME="1", RUN_NAME="x", MAX_STEPS="9"))
    assert longer.returncode == 0, longer.stderr[-2000:]
    assert "done: 9 steps" in longer.stdout and [s for s, _ in losses(runs / "x")] == list(range(1, 10))
    assert json.loads((runs / "x" / "summary.json").read_text())["batch_size"] == 2
    shorter = dpo_launch(dpo_env(dpo_root, RESUME="1", RUN_NAME="x", MAX_STEPS="3"))
    assert shorter.returncode == 2 and shorter.stderr.strip().splitlines() == [
        "error: RESUME=1: MAX_STEPS=3 is below the step the checkpoint is at (9): set MAX_STEPS above 9, "
        "or leave it out to finish the run's own 9"]  # fmt: skip


def test_a_micro_batch_given_on_resume_is_taken(dpo_root):
    """The user's own setting still wins: the positional micro-batch and a variable alike."""
    env = dpo_env(dpo_root, RUN_NAME="given", MAX_STEPS="2", LOG_EVERY="1")
    assert dpo_launch(env, "2").returncode == 0
    shown = dpo_launch({**env, "RESUME": "1", "MAX_STEPS": "3", "SHOW_COMMAND": "1"}, "4").stdout
    assert (
        "--batch_size 4" in shown
        and "--gradient_accumulation_steps" not in shown
        and "--max_steps 3" in shown
    )
    shown = dpo_launch({**env, "RESUME": "1", "SHOW_COMMAND": "1", "BATCH_SIZE": ""}).stdout
    assert "--batch_size" not in shown  # empty is not set: the run's own
    again = dpo_launch({**env, "RESUME": "1", "MAX_STEPS": "3"}, "4")
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads((dpo_root / "runs" / "given" / "summary.json").read_text())["batch_size"] == 4


# ---- the final loss of an interrupted run is the last step's --------------------------------------


def test_an_interrupted_runs_final_loss_is_its_last_steps(tiny_flags, tmp_path):
    runs = tmp_path / "runs"
    steps = ["--max_steps", "70", "--batch_size", "2", "--max_length", "32", "--val_fraction", "0"]
    # LOG_EVERY=1: every step's loss
    assert run_cli("pretrain", *tiny_flags, *steps, "--run_name", "whole") == 0
    every = dict(losses(runs / "whole"))
    flags = [a if a != "1" or tiny_flags[i - 1] != "--log_every" else "25" for i, a in enumerate(tiny_flags)]
    flags += ["--save_every", "28"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [train_python(), "-m", "train", "pretrain", *flags, *steps, "--run_name", "cut"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    log = runs / "cut" / "train.log"
    # after step 28's checkpoint: between the log lines of steps 25 and 50
    signal_when(
        proc, lambda: log.exists() and "saved checkpoint step-00000028" in log.read_text(), signal.SIGTERM
    )
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-2000:]
    summary = json.loads((runs / "cut" / "summary.json").read_text())
    step = summary["steps"]
    print(f"SIGTERM seen at step {step} (last logged: {losses(runs / 'cut')[-1][0]})")
    assert summary["exit_reason"] == "interrupted" and 28 <= step < 50  # the last logged step: 25
    assert summary["final_loss"] == pytest.approx(every[step], abs=1e-5)
    done = next(line for line in out.splitlines() if line.startswith("done: "))
    assert done.startswith(f"done: {step} steps, final loss {every[step]:.4f}")


# ---- make compare, interrupted, then resumed -------------------------------------------------------


def test_an_interrupted_make_compare_says_a_command_that_works(corpus, tiny_config, tmp_path):
    env = launcher_env(
        {
            "MODEL_CONFIG": str(tiny_config),
            "DATA_PATH": str(corpus),
            "VOCAB_SIZE": "512",
            "CACHE_DIR": str(tmp_path / "cache"),
            "OUTPUT_DIR": str(tmp_path / "runs"),
            "MAX_LENGTH": "32",
            "DEVICE": "cpu",
            "SAVE_EVERY": "4",
            "LOG_EVERY": "1",
            "OMP_NUM_THREADS": "1",
            "NUM_WORKERS": "0",
            "BATCH_SIZE": "16",
            "GRADIENT_ACCUM": "1",
        }
    )
    budget = {"COMPARE_SAMPLES": "256"}  # 32 baseline steps of 8, 16 of 16
    proc = subprocess.Popen(
        ["make", "--no-print-directory", "compare", *(f"{k}={v}" for k, v in budget.items())],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    baseline = tmp_path / "runs" / "compare-baseline"
    kill_when(proc, baseline / "metrics.jsonl", 6, signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    line = out.strip().splitlines()[-1]
    assert line == ("interrupted: to continue from the last checkpoint, run make compare RESUME=1 "
                    "COMPARE_SAMPLES=256 "
                    "(with the other variables you gave it)"), (out[-1500:], err[-1500:])  # fmt: skip
    stopped_at = json.loads((baseline / "summary.json").read_text())["steps"]
    command = re.search(r"run (make .*) \(with", line).group(1).split()
    again = subprocess.run([command[0], "--no-print-directory", *command[1:]], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=600)  # fmt: skip
    assert again.returncode == 0, (again.stdout[-2000:], again.stderr[-2000:])
    assert f"-> {baseline} (256 samples, resumed)" in again.stdout
    assert "compare-optimized (256 samples)" in again.stdout and "comparison written to" in again.stdout
    summary = json.loads((baseline / "summary.json").read_text())
    assert (
        summary["resumed_from_step"] == stopped_at and summary["steps"] == 32 and summary["batch_size"] == 8
    )
    assert [s for s, _ in losses(baseline)] == list(range(1, 33))
    assert math.isfinite(
        json.loads((tmp_path / "runs" / "compare-optimized" / "summary.json").read_text())["final_loss"]
    )
    shutil.rmtree(tmp_path / "runs")
