"""OPTIMIZER=adafactor_relative (ChatLM's optimizer: Adafactor with a relative step and parameter
scaling) against transformers' Adafactor(lr=None, relative_step=True, scale_parameter=True,
warmup_init=False) as the oracle, step for step on tiny real models; its curve as the logged lr and
the plan's decision line; a run that resumes from its checkpoint to the uninterrupted run's losses.
WARMUP_STEPS below 1 as a share of the run (TRL 1.16's float warmup_steps)."""

import json
import shutil

import numpy as np
import pytest
import torch
from test_optimizers import tiny_t5
from tiny_tools import one_thread
from transformers.optimization import Adafactor

import config
from conftest import read_jsonl, run_cli, tiny_model
from train.core.optim.registry import build_optimizer, build_schedule
from train.core.optim.schedules import warmup_of
from train.core.step import train_step
from train.models.build import build_model
from train.models.family import CAUSAL_LM, ENCODER_DECODER
from train.run.checkpoint import on_disk
from train.run.plan.make import Decisions, resolve_pacing

CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from one_thread()


def oracle(model, weight_decay: float):
    """transformers' Adafactor on the kit's two groups (decay on matrices only)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return Adafactor(groups, lr=None, relative_step=True, scale_parameter=True, warmup_init=False)


def batches(seq2seq: bool, seed: int = 0):
    """One batch again and again: a loss that falls as the model learns it."""
    gen = torch.Generator().manual_seed(seed)
    if seq2seq:
        batch = {"input_ids": torch.randint(2, 512, (4, 16), generator=gen),
                 "attention_mask": torch.ones(4, 16, dtype=torch.long),
                 "labels": torch.randint(2, 512, (4, 8), generator=gen)}  # fmt: skip
    else:
        batch = {"input_ids": torch.randint(0, 512, (4, 32), generator=gen)}
    while True:
        yield batch


@pytest.mark.parametrize("family, weight_decay", [("gpt2", 0.1), ("t5", 0.0)])
def test_twenty_steps_equal_transformers_adafactor_relative_step(family, weight_decay):
    make = (lambda: build_model(tiny_t5(), False, 0)) if family == "t5" else tiny_model
    ours, theirs = make(), make()
    theirs.load_state_dict(ours.state_dict())
    optim = config.OptimConfig(optimizer="adafactor_relative", learning_rate=123.0, weight_decay=weight_decay)
    kit_opt, kind = build_optimizer(optim, ours, CPU)
    assert kind.startswith("Adafactor (relative step")
    ref_opt = oracle(theirs, weight_decay)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    seq2seq = family == "t5"
    a, b = batches(seq2seq), batches(seq2seq)
    losses = []
    for step in range(20):
        for group in kit_opt.param_groups:  # the loop writes the schedule's lr each step: never read
            group["lr"] = 1e3
        losses.append(
            float(
                train_step(
                    ours,
                    kit_opt,
                    scaler,
                    a,
                    1,
                    1.0,
                    CPU,
                    "fp32",
                    layout=ENCODER_DECODER if seq2seq else CAUSAL_LM,
                )[0]
            )
        )
        ref = float(
            train_step(
                theirs,
                ref_opt,
                scaler,
                b,
                1,
                1.0,
                CPU,
                "fp32",
                layout=ENCODER_DECODER if seq2seq else CAUSAL_LM,
            )[0]
        )
        assert losses[-1] == pytest.approx(ref, abs=1e-6), step
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=name)  # bit for bit on this CPU, in fact
    assert losses[-1] < losses[0] - 0.05, losses
    # the state: a factored row and column per matrix, a host step count, tensors only
    matrix = next(p for p in ours.parameters() if p.dim() == 2)
    held = kit_opt.state[matrix]
    assert held["row"].shape == (matrix.shape[0], 1) and held["col"].shape == (1, matrix.shape[1])
    assert held["step"].device.type == "cpu" and float(held["step"]) == 20


def test_the_schedule_is_its_relative_step_and_the_plan_says_the_lr_is_unused():
    optim = config.OptimConfig(optimizer="adafactor_relative", learning_rate=5e-4, lr_schedule="onecycle")
    schedule = build_schedule(optim, 8, 10, 100_000)
    assert [schedule.lr(8 * s) for s in (0, 9, 9_999)] == [1e-2, 1e-2, 1e-2]
    assert schedule.lr(8 * 39_999) == pytest.approx(1 / 200)  # min(1e-2, 1/sqrt(step)), step 40000
    said = []
    cfg = config.resolve(None, {"optimizer": "adafactor_relative", "log_every": 1})
    resolve_pacing(cfg, 20, Decisions(said.append))
    assert any(
        "lr_schedule = relative" in line and "LEARNING_RATE, LR_SCHEDULE and WARMUP_STEPS are unused" in line
        for line in said
    ), said


def test_warmup_steps_below_one_is_a_share_of_the_run(tiny_flags, capsys):
    assert config.OptimConfig(warmup_steps=100.0).warmup_steps == 100  # whole: steps, kept as an int
    # ceil, as transformers
    assert warmup_of(0.1, 25) == 3 and warmup_of(0.05, 1000) == 50 and warmup_of(0, 10) == 0
    said = []
    cfg = config.resolve(None, {"warmup_steps": 0.1, "log_every": 1})
    assert resolve_pacing(cfg, 25, Decisions(said.append)) == 3
    assert cfg.optim.warmup_steps == 0.1 and any(
        "WARMUP_STEPS=0.1: that share of the run's 25 steps" in s for s in said
    )
    for bad, expect in [
        ("2.5", "a whole number of steps, or a share of the run below 1"),
        ("-0.1", ">= 0.0"),
    ]:
        assert run_cli("pretrain", *tiny_flags, "--max_steps", "2", "--warmup_steps", bad) == 2
        err = capsys.readouterr().err.strip()
        assert (
            len(err.splitlines()) == 1
            and err.startswith("error: WARMUP_STEPS (--warmup_steps)")
            and expect in err
        )


def test_a_warmup_share_sets_the_logged_lr(tiny_flags, tmp_path):
    flags = ["--batch_size", "4", "--max_steps", "4", "--warmup_steps", "0.5", "--learning_rate", "1e-3",
             "--lr_schedule", "constant", "--run_name", "share"]  # fmt: skip
    assert run_cli("pretrain", *tiny_flags, *flags) == 0
    lrs = [r["lr"] for r in read_jsonl(tmp_path / "runs" / "share" / "metrics.jsonl") if "lr" in r]
    np.testing.assert_allclose(lrs, [5e-4, 1e-3, 1e-3, 1e-3], rtol=1e-12)  # 2 warm-up steps of 4


RUN = ["--batch_size", "4", "--max_steps", "4", "--save_every", "2", "--keep_checkpoints", "5", "--seed", "3",
       "--optimizer", "adafactor_relative", "--weight_decay", "0"]  # fmt: skip


def test_adafactor_relative_resume_gives_the_uninterrupted_losses(tiny_flags, tmp_path):
    runs = tmp_path / "runs"
    assert run_cli("pretrain", *tiny_flags, *RUN, "--run_name", "ref") == 0
    ref = [r for r in read_jsonl(runs / "ref" / "metrics.jsonl") if "loss" in r]
    record = json.loads((runs / "ref" / "config.json").read_text())
    assert record["config"]["optim"]["optimizer"] == "adafactor_relative"
    assert any(d["setting"] == "lr_schedule" and d["value"] == "relative" for d in record["decisions"])
    assert [r["lr"] for r in ref] == [1e-2] * 4  # the relative step, not LEARNING_RATE's curve
    shutil.copytree(runs / "ref", runs / "cut", symlinks=True)
    for path in on_disk.list_checkpoints(runs / "cut" / "checkpoints"):
        if int(path.name.split("-")[1]) > 2:
            shutil.rmtree(path)
    assert run_cli("pretrain", *tiny_flags, *RUN, "--run_name", "cut", "--resume", "1") == 0
    rows = [r for r in read_jsonl(runs / "cut" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    np.testing.assert_allclose([r["loss"] for r in rows], [r["loss"] for r in ref], rtol=0, atol=1e-6)
