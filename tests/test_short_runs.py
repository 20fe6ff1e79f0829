"""A newcomer's short runs and help (issue 28, items 10 and 11): the help of each command says
what it does and lists only its own flags; a short run's final evaluation is sized to what it
trained (the same for any BATCH_SIZE); a decision confirmed later prints once; Ctrl+C ends with
the command that resumes; make compare's CPU budget is small; sft-bench logs under runs/."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

from config import resolve
from conftest import ROOT, read_jsonl, run_cli
from train.distributed.process_group import SINGLE
from train.run.plan.make import Decisions, sized_validation


def help_of(capsys, *argv) -> str:
    try:
        code = run_cli(*argv, "--help")
    except SystemExit as stop:  # argparse's --help
        code = stop.code
    assert code in (0, None)
    return capsys.readouterr().out


def test_help_says_what_each_command_does_and_only_its_flags(capsys):
    top = help_of(capsys)
    assert "causal LM from scratch" not in top and "T5 (encoder-decoder)" in top and ".venv/bin/python" in top
    pretrain = help_of(capsys, "pretrain")
    assert "Train (pretrain)." not in pretrain and "Pretrain a model from scratch on text" in pretrain
    assert (
        "--packing" not in pretrain and "--model_path" not in pretrain and "{baseline,optimized}" in pretrain
    )
    sft = help_of(capsys, "sft")
    assert "--packing" in sft and "--model_path" in sft and "{baseline,optimized,sft}" in sft
    doctor = help_of(capsys, "doctor")
    assert doctor.startswith("usage: python -m train doctor [--apply] [--steps N] [training flags]")
    own = doctor.split("doctor's own flags:")[1]
    assert "--apply" in own and "--steps N" in own and "--packing" not in doctor
    assert "--skip LIST" in help_of(capsys, "autotune").split("autotune's own flags:")[1]
    assert run_cli("pretrain", "--packing", "1") == 2  # hidden, still refused in one line
    assert "PACKING (--packing) does not apply to pretraining" in capsys.readouterr().err


def test_a_decision_confirmed_later_prints_once():
    said = []
    decide = Decisions(said.append)
    decide("num_workers", 2, "NUM_WORKERS=4 but only 2 CPU cores")
    decide("num_workers", 2, "kept: RAM covers 2 workers")
    decide("num_workers", 1, "RAM covers 1 worker")  # a further change is its own line
    assert said == ["  num_workers = 2  (NUM_WORKERS=4 but only 2 CPU cores)", "  num_workers = 1  (RAM "
                                                                               "covers 1 worker)"]
    assert decide.items[0]["reason"] == "NUM_WORKERS=4 but only 2 CPU cores; kept: RAM covers 2 workers"


def test_short_runs_evaluate_what_they_trained_the_same_for_any_batch(tiny_flags, tmp_path):
    assert (
        run_cli("pretrain", *tiny_flags, "--batch_size", "4", "--max_steps", "2", "--run_name", "short") == 0
    )
    run = tmp_path / "runs" / "short"
    decisions = {d["setting"]: d for d in json.loads((run / "config.json").read_text())["decisions"]}
    assert decisions["eval_size"]["value"].startswith("8 of ")  # 2 steps x 4 sequences, not 20 batches of 4
    assert json.loads((run / "summary.json").read_text())["val_sequences"] == 8

    held_out = list(range(100))  # the plan's rule, for runs a compare sets side by side
    kept = []
    for batch, accum, steps in ((8, 1, 4), (2, 4, 4), (32, 1, 1)):
        cfg = resolve(None, {"batch_size": batch, "gradient_accumulation_steps": accum})
        kept.append(list(sized_validation(cfg, held_out, steps, SINGLE, Decisions(lambda line: None))))
    assert kept[0] == kept[1] == kept[2] == list(range(32))  # the same 32 sequences, whatever the batch
    cfg = resolve(None, {"batch_size": 8})
    # a long run: all of it
    assert sized_validation(cfg, held_out, 1000, SINGLE, Decisions(print)) is held_out


def test_ctrl_c_ends_with_the_command_that_resumes(tiny_flags, tmp_path, capsys):
    run = tmp_path / "runs" / "stopped"

    def press_ctrl_c():
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            metrics = run / "metrics.jsonl"
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
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
        "--run_name",
        "stopped",
        "--launcher",
        "run_single_gpu",
    ]
    assert run_cli("pretrain", *argv) == 130
    presser.join()
    last = capsys.readouterr().out.strip().splitlines()[-1]
    # a command that runs as it is: where the run is, and the launcher default it did not use
    assert last == (f"interrupted: to continue from the last checkpoint, run RESUME=1 RUN_NAME=stopped "
                    f"OUTPUT_DIR="
                    f"{tmp_path / 'runs'} BATCH_SIZE=4 ./run_single_gpu.sh (its other settings are kept)")
    assert read_jsonl(run / "metrics.jsonl")


FAKE_PYTHON = """#!{python}
import json, os, sys
from pathlib import Path

args = sys.argv[1:]
if args[:2] != ["-m", "train"] or args[2] not in ("pretrain", "sft"):  # knob lists, compare, heredocs: real
    os.execv({python!r}, [{python!r}, *args])
flags = dict(zip(args[3::2], args[4::2]))
run = Path(flags.get("--output_dir", "runs")) / flags["--run_name"]
run.mkdir(parents=True, exist_ok=True)
(run / "flags.json").write_text(json.dumps(flags))
(run / "summary.json").write_text(json.dumps({{
    "run_name": run.name, "mode": args[2], "samples_per_sec": 2.0, "tokens_per_sec": 100.0,
    "step_time_ms": 5.0,
    "padding_efficiency": 0.5, "final_loss": 4.0, "steps": 4, "tokens": 400, "steady_state_steps": 3,
    "exit_reason": "completed"}}))
print("a fake run of", flags["--run_name"])
"""


def test_cpu_compare_budget_is_small_and_sft_bench_logs_under_runs(tmp_path):
    kit = tmp_path / "kit"
    (kit / "scripts").mkdir(parents=True)
    for name in (
        "run_single_gpu.sh",
        "run_single_gpu_optimized.sh",
        "train_sft_custom.sh",
        "quick_start_sft_fast.sh",
        "scripts/common.sh",
        "scripts/compare.sh",
        "scripts/bench_sft.sh",
    ):
        shutil.copy2(ROOT / name, kit / name)
    for name in ("train", "config.py"):
        (kit / name).symlink_to(ROOT / name)
    (kit / ".venv" / "bin").mkdir(parents=True)
    fake = kit / ".venv" / "bin" / "python"
    fake.write_text(FAKE_PYTHON.format(python=sys.executable))
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR")}
    env.update(OUTPUT_DIR=str(kit / "runs"), DEVICE="cpu", MAX_STEPS="4")

    def run(*argv, **more):
        result = subprocess.run(["bash", *argv], env={**env, **more}, capture_output=True, text=True, cwd=kit,
                                timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
        return result.stdout

    out = run("scripts/bench_sft.sh")
    logs = sorted((kit / "runs").glob("sft-bench-*-logs/*.log"))
    assert [p.name for p in logs] == ["grouping.log", "packing.log", "plain.log"]
    assert "a fake run of sft-bench-" in logs[2].read_text() and f"logs: {kit / 'runs'}" in out

    env.pop("MAX_STEPS")
    # CPU: 256 single conversations (8 steady-enough steps of 32 on the fast side)
    run("scripts/compare.sh", "sft")
    assert (
        json.loads((kit / "runs" / "compare-sft-batch1" / "flags.json").read_text())["--max_samples"] == "256"
    )


def test_the_resume_line_keeps_the_custom_launchers_micro_batch():
    from train.run.rundir.report import resume_line

    assert "RESUME=1 RUN_NAME=x ./train_sft_custom.sh 4 (its" in resume_line("x", "train_sft_custom", 4)
    assert "./quick_start_sft_fast.sh (its" in resume_line("x", "quick_start_sft_fast", 16)
