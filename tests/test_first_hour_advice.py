"""The kit's advice in the README's first hour is runnable as printed (the issue: DPO on the 30-step SFT
run said "train it longer (MODEL_PATH=runs/<pretraining run>/final DATA_PATH=chat.jsonl ...)": a
placeholder and a file the user lacks), and never asks for a MAX_LENGTH past the model's context."""

from __future__ import annotations

import json
import subprocess
from types import SimpleNamespace

from conftest import ROOT, launcher_env, run_cli
from train.data.preference import longer
from train.run.plan.sft_model import FEW_STEPS, choose_pretrained, model_source

FAST = ["--batch_size", "4", "--num_workers", "0", "--max_steps", "2"]


def dpo_warning(runs) -> list[str]:
    said = []
    cfg = SimpleNamespace(
        model=SimpleNamespace(model_path=None), run=SimpleNamespace(output_dir=str(runs), mode="dpo")
    )
    model_source(cfg, lambda *a: None, said.append)
    return said


def test_a_short_sft_runs_advice_runs_as_printed(tiny_flags, tmp_path, cache_dir):
    runs = tmp_path / "runs"
    assert run_cli("pretrain", *tiny_flags, *FAST, "--run_name", "base", "--launcher", "run_single_gpu") == 0
    # the README's step 2: MODEL_PATH=runs/latest/final, which moves to the SFT run once it completes
    latest = runs / "latest" / "final"
    sft = ["--output_dir", str(runs), "--cache_dir", str(cache_dir), "--max_length", "64", "--log_every", "1"]
    assert run_cli("sft", *sft, *FAST, "--model_path", str(latest), "--run_name", "short",
                   "--launcher", "train_sft_custom") == 0  # fmt: skip
    assert (runs / "latest").resolve() == (runs / "short").resolve()

    (warning,) = dpo_warning(runs)
    assert f"trained only 2 optimizer steps (under {FEW_STEPS})" in warning, warning
    command = warning.split("train it longer (`", 1)[1].split("`", 1)[0]
    assert "<" not in command and "chat.jsonl" not in command and "latest" not in command, command
    # MODEL_PATH: SFT's default, the base run
    assert command == f"MAX_STEPS={FEW_STEPS} ./train_sft_custom.sh"

    # as printed, from the kit's folder (OUTPUT_DIR and CACHE_DIR: where this test keeps its runs)
    env = launcher_env(
        {"OUTPUT_DIR": str(runs), "CACHE_DIR": str(cache_dir), "MAX_LENGTH": "64", "NUM_WORKERS": "0"}
    )
    done = subprocess.run(
        ["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    longer_run = (runs / "latest").resolve()
    summary = json.loads((longer_run / "summary.json").read_text())
    assert summary["mode"] == "sft" and summary["steps"] == FEW_STEPS
    config = json.loads((longer_run / "config.json").read_text())
    chosen = [d["value"] for d in config["decisions"] if d["setting"] == "model_path"]
    assert chosen == [str(choose_pretrained(runs).final)]  # the same base model as the short run's
    assert dpo_warning(runs) == []  # DPO now starts from it without a warning


def test_the_reply_cut_advice_stays_within_the_models_context():
    assert "raise MAX_LENGTH" not in longer(256, 256)
    assert "already the model's context" in longer(256, 256)
    assert "raise MAX_LENGTH (up to the model's context, 1024)" in longer(256, 1024)
