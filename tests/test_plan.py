"""One plan for every mode: SFT decides EFFECTIVE_BATCH, LR_SCALING and the memory-adaptive
settings exactly as pretraining does, and the plan is a frozen value."""

from __future__ import annotations

import dataclasses
import json

import pytest

from conftest import run_cli
from train.config.flags import parse_training_args
from train.run.plan.build import build

SAME_BATCH = [
    "--batch_size",
    "2",
    "--effective_batch",
    "16",
    "--lr_scaling",
    "linear",
    "--lr_reference_batch",
    "8",
    "--learning_rate",
    "1e-4",
    "--num_workers",
    "0",
    "--max_length",
    "64",
    "--pin_memory",
    "1",
]


def decided(plan) -> dict:
    return {d["setting"]: d["value"] for d in plan.decisions}


@pytest.fixture
def plans(base_model, tiny_flags, tmp_path):
    """(pretraining plan, SFT plan) of the same batch settings, with the lines each printed."""
    lines = {"pretrain": [], "sft": []}
    sft = ["--model_path", str(base_model), "--output_dir", str(tmp_path / "runs"), "--max_steps", "2"]
    pre = [*tiny_flags, "--max_steps", "2"]
    made = {}
    for mode, argv in (("pretrain", pre), ("sft", sft)):
        asked = parse_training_args(mode, [*argv, *SAME_BATCH])
        made[mode] = build(asked, lines[mode].append)
        assert asked.optim.gradient_accumulation_steps == 1  # the asked config is left as it was
    return made, lines


def test_sft_plans_effective_batch_and_lr_scaling_as_pretraining_does_in_a_frozen_plan(plans):
    made, lines = plans
    for mode, plan in made.items():
        o = plan.cfg.optim
        assert (o.batch_size, o.gradient_accumulation_steps) == (2, 8), mode
        assert o.learning_rate == pytest.approx(2e-4), mode  # linear: 1e-4 x 16 / 8
        assert decided(plan)["gradient_accumulation_steps"] == 8, mode
        assert decided(plan)["learning_rate"] == pytest.approx(2e-4), mode
        assert any("EFFECTIVE_BATCH=16 / (BATCH_SIZE=2" in line for line in lines[mode]), mode
        assert decided(plan)["pin_memory"] is False, mode  # the memory-adaptive settings too (no CUDA here)
    plan = made["sft"]  # a frozen value: nothing changes it after planning
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.total_steps = 99
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.cfg = None
    with pytest.raises(TypeError):
        plan.summary_extra["model_path"] = "elsewhere"  # read-only mapping


def test_sft_dry_run_prints_the_accumulation_it_plans(base_model, tmp_path, capsys):
    argv = ["--model_path", str(base_model), "--output_dir", str(tmp_path / "runs"), "--max_steps", "2",
            "--dry_run", "1", *SAME_BATCH]  # fmt: skip
    assert run_cli("sft", *argv) == 0
    out = capsys.readouterr().out
    assert "effective batch 16 = BATCH_SIZE 2 x GRADIENT_ACCUM 8" in out
    assert "gradient_accumulation_steps = 8  (EFFECTIVE_BATCH=16" in out
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
    json.dumps(out)  # printable as it is


def test_oom_guard_holds_the_smaller_micro_batch_and_leaves_the_plan_alone(tiny_flags):
    """After an out-of-memory the guard trains with half the micro-batch; the plan keeps its own."""
    import types

    import torch

    from train.run.loop.oom import OomGuard

    cfg = parse_training_args(
        "pretrain", [*tiny_flags, "--batch_size", "8", "--gradient_accumulation_steps", "2"]
    )
    plan = types.SimpleNamespace(cfg=cfg, device=torch.device("cpu"), max_length=64, precision="fp32",
                                 objective=None)
    opened = []

    class Stream:
        epoch, consumed = 0, 0

        def remaining(self, offset):
            return 1000

        def close(self):
            pass

    def open_stream(batch_size, epoch, start):
        opened.append((batch_size, epoch, start))
        return Stream()

    guard = OomGuard(
        plan, open_stream, torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), None, print
    )
    guard.open()
    failures = iter([torch.OutOfMemoryError("CUDA out of memory. (fake)")])

    def step():
        err = next(failures, None)
        if err:
            raise err
        return "done"

    assert guard.step(step) == "done"
    assert (guard.batch_size, guard.accumulation, guard.retries) == (4, 4, 1)
    assert opened == [(8, 0, 0), (4, 0, 0)]  # the failed step's first sample, at the new micro-batch
    assert (cfg.optim.batch_size, cfg.optim.gradient_accumulation_steps) == (8, 2)
