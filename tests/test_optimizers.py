"""OPTIMIZER, LR_SCHEDULE and FREEZE: the schedules' curves (onecycle against torch's own
OneCycleLR), each optimizer training a tiny model with the state it should hold, frozen
parameters untouched and out of the memory estimate, bad values as one line, and an Adafactor +
onecycle + FREEZE run that resumes to exactly the uninterrupted run's losses."""

import json
import shutil

import numpy as np
import pytest
import torch
from tiny_tools import one_thread

import config
from conftest import read_jsonl, run_cli, tiny_model
from train.core.optim.registry import build_optimizer, build_schedule
from train.core.optim.schedules import lr_at
from train.core.step import train_step
from train.models.build import build_config, build_model
from train.models.estimate import (
    count_params,
    estimate_for_run,
    estimate_memory,
    optimizer_bytes,
)
from train.models.family import CAUSAL_LM, ENCODER_DECODER
from train.models.freeze import apply_freeze, trainable_for, trainable_of
from train.run.checkpoint import on_disk

CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from one_thread()


def test_cosine_linear_constant_curves_at_known_steps():
    # warm-up: step 0 is peak / warmup, step warmup - 1 the peak, for every shape but onecycle
    for shape in ("cosine", "linear", "constant"):
        assert lr_at(0, 1.0, 10, 110, 0.1, shape) == pytest.approx(0.1)
        assert lr_at(9, 1.0, 10, 110, 0.1, shape) == pytest.approx(1.0)
    assert lr_at(60, 1.0, 10, 110, 0.1, "cosine") == pytest.approx(0.55)  # half-way: the mean of peak and end
    assert lr_at(60, 1.0, 10, 110, 0.1, "linear") == pytest.approx(0.55)
    assert lr_at(35, 1.0, 10, 110, 0.1, "linear") == pytest.approx(0.775)  # a quarter of the way: linear
    assert lr_at(35, 1.0, 10, 110, 0.1, "cosine") == pytest.approx(0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi / 4)))
    assert lr_at(110, 1.0, 10, 110, 0.1, "linear") == pytest.approx(0.1)
    assert [lr_at(s, 1.0, 10, 110, 0.1, "constant") for s in (10, 60, 109)] == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("warmup, total", [(5, 20), (0, 12), (3, 7)])
def test_onecycle_is_torch_onecyclelr_step_for_step(warmup, total):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt,
        max_lr=3e-3,
        total_steps=total,
        pct_start=warmup / total,
        anneal_strategy="cos",
        cycle_momentum=False,
        div_factor=25.0,
        final_div_factor=1e4,
    )
    theirs = []
    for step in range(total):
        theirs.append(opt.param_groups[0]["lr"])
        opt.step()
        if step < total - 1:
            sched.step()
    ours = [lr_at(step, 3e-3, warmup, total, 0.1, "onecycle") for step in range(total)]
    np.testing.assert_allclose(ours, theirs, rtol=1e-12, atol=0)
    assert ours[-1] == pytest.approx(3e-3 / 25 / 1e4)
    # the kit's Schedule gives the same curve over samples (effective batch 8)
    optim = config.OptimConfig(learning_rate=3e-3, lr_schedule="onecycle")
    schedule = build_schedule(optim, 8, warmup, total)
    np.testing.assert_allclose([schedule.lr(8 * s) for s in range(total)], theirs, rtol=1e-12, atol=0)


def lm_batches(seed: int = 0):
    ids = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(seed))
    while True:
        yield {"input_ids": ids}


def run_steps(model, optim, steps: int = 4):
    optimizer, kind = build_optimizer(optim, model, CPU)
    scaler, batches = torch.amp.GradScaler("cpu", enabled=False), lm_batches()
    losses = [
        float(train_step(model, optimizer, scaler, batches, 1, 1.0, CPU, "fp32", layout=CAUSAL_LM)[0])
        for _ in range(steps)
    ]
    return losses, optimizer, kind


@pytest.mark.parametrize(
    "name, lr, state",
    [
        ("adamw", 3e-3, {"exp_avg", "exp_avg_sq"}),
        ("sgd", 0.3, {"momentum_buffer"}),
        ("adafactor", 3e-2, {"row_var"}),
    ],
)
def test_each_optimizer_trains_a_tiny_model_with_its_own_state(name, lr, state):
    model = tiny_model()
    losses, optimizer, kind = run_steps(
        model, config.OptimConfig(optimizer=name, learning_rate=lr, weight_decay=0.1)
    )
    assert losses[-1] < losses[0] - 0.05, losses
    assert kind.lower().startswith(name[:4])
    matrix = model.transformer.h[0].mlp.c_fc.weight  # (64, 256)
    held = optimizer.state[matrix]
    assert state <= set(held)
    if name == "adafactor":  # factored: a row and a column, not a matrix
        assert held["row_var"].numel() + held["col_var"].numel() == 64 + 256
    decays = {g["weight_decay"] for g in optimizer.param_groups}
    assert decays == {0.1, 0.0}  # matrices decay, biases and norms do not, whichever optimizer


@pytest.mark.parametrize("name", ["adamw", "sgd", "adafactor"])
def test_optimizer_step_memory_is_what_the_estimate_counts(name):
    """torch's MemTracker over a real optimizer step (state already made), with a frozen part:
    weights + trained gradients + the optimizer's state and temporaries, as estimate.py counts."""
    from torch.distributed._tools.mem_tracker import MemTracker

    model = tiny_model()
    apply_freeze(model, "transformer.h.0.*")
    optimizer, _ = build_optimizer(config.OptimConfig(optimizer=name), model, CPU)
    for _ in range(2):  # the first step makes the state; the second is measured
        for p in model.parameters():
            p.grad = torch.randn_like(p) if p.requires_grad else None
        tracker = MemTracker()
        tracker.track_external(model, optimizer)
        with tracker:
            optimizer.step()
    measured = tracker.get_tracker_snapshot("peak")[CPU]["Total"]
    trained = trainable_of(model)
    state, temporaries = optimizer_bytes(name, trained.params, trained.factored)
    counted = 4 * count_params(model.config) + 4 * trained.params + state + temporaries
    assert measured == pytest.approx(counted, rel=0.01)


def test_freeze_leaves_frozen_weights_unchanged_and_out_of_the_optimizer():
    model = tiny_model()
    why = apply_freeze(model, "embeddings,transformer.h.0.*")
    assert "tied, so frozen together: transformer.wte.weight=lm_head.weight" in why
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    assert {"transformer.wte.weight", "transformer.wpe.weight", "transformer.h.0.attn.c_attn.weight"} <= set(
        frozen
    )
    assert all(p.requires_grad for n, p in model.named_parameters() if n.startswith("transformer.h.1."))
    losses, optimizer, _ = run_steps(model, config.OptimConfig(learning_rate=3e-3))
    assert losses[-1] < losses[0]
    after = dict(model.named_parameters())
    assert all(torch.equal(after[n], before) for n, before in frozen.items())
    assert not torch.equal(
        after["transformer.h.1.mlp.c_fc.weight"], tiny_model().transformer.h[1].mlp.c_fc.weight
    )
    held = sum(p.numel() for group in optimizer.param_groups for p in group["params"])
    assert (
        held
        == trainable_of(model).params
        == count_params(model.config) - sum(p.numel() for p in frozen.values())
    )


def tiny_t5():
    hf = build_config("nano", None, 512, 0, "t5")
    hf.d_model, hf.num_layers, hf.num_decoder_layers, hf.num_heads, hf.d_kv, hf.d_ff = 32, 2, 2, 2, 16, 64
    hf.dropout_rate = 0.0
    return hf


def test_freeze_encoder_of_a_t5_trains_only_the_rest_and_the_estimate_shrinks():
    hf = tiny_t5()
    model = build_model(hf, False, 0)
    apply_freeze(model, "embeddings,encoder")  # ChatLM's fine-tuning: the shared table and the encoder
    encoder = {n: p.detach().clone() for n, p in model.encoder.named_parameters()}
    assert (
        all(not p.requires_grad for p in model.encoder.parameters()) and not model.shared.weight.requires_grad
    )
    assert model.decoder.block[0].layer[0].SelfAttention.q.weight.requires_grad
    optimizer, _ = build_optimizer(config.OptimConfig(learning_rate=1e-2), model, CPU)
    gen = torch.Generator().manual_seed(0)
    batch = {
        "input_ids": torch.randint(2, 512, (4, 16), generator=gen),
        "attention_mask": torch.ones(4, 16, dtype=torch.long),
        "labels": torch.randint(2, 512, (4, 8), generator=gen),
    }
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    for _ in range(2):
        train_step(model, optimizer, scaler, iter([batch]), 1, 1.0, CPU, "fp32", layout=ENCODER_DECODER)
    assert all(torch.equal(p, encoder[n]) for n, p in model.encoder.named_parameters())
    # the estimate: gradients and optimizer state only for what trains, per optimizer
    counted = trainable_for(hf, "embeddings,encoder")
    assert counted == trainable_of(model)
    n = count_params(hf)
    whole = estimate_memory(hf, n, batch_size=4, max_length=16, precision="fp32")
    part = estimate_memory(
        hf, n, batch_size=4, max_length=16, precision="fp32", trainable_params=counted.params
    )
    assert part["gradients"] == 4 * counted.params < whole["gradients"] == 4 * n
    assert part["optimizer"] == 8 * counted.params and part["peak"] < whole["peak"]
    assert part["weights"] == whole["weights"]  # frozen weights still live on the device
    sizes = {}
    for name in ("adamw", "sgd", "adafactor"):
        cfg = config.resolve(None, {"optimizer": name, "freeze": "encoder", "mode": "pretrain"})
        sizes[name] = estimate_for_run(hf, n, cfg, 16, "fp32", "cuda")["optimizer"]
    assert sizes["adafactor"] < sizes["sgd"] == sizes["adamw"] / 2


def test_bad_values_stop_in_one_line(tiny_flags, capsys):
    cases = [
        (["--optimizer", "adam"], "OPTIMIZER (--optimizer): expected adamw | adafactor | sgd"),
        (["--lr_schedule", "step"], "LR_SCHEDULE (--lr_schedule)"),
        (["--optimizer", "adafactor", "--sharding", "zero2"], "OPTIMIZER=adafactor and SHARDING=zero2"),
        (["--freeze", "encoder"], "FREEZE=encoder: encoder names an encoder-decoder's encoder"),
        (
            ["--freeze", "embeddings,no.such.*"],
            "FREEZE=embeddings,no.such.*: 'no.such.*' matches no parameter",
        ),
    ]
    for flags, expect in cases:
        assert run_cli("pretrain", *tiny_flags, "--max_steps", "2", *flags) == 2, flags
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and expect in err and err.startswith("error: "), err


RUN = [
    "--batch_size",
    "4",
    "--max_steps",
    "4",
    "--save_every",
    "2",
    "--keep_checkpoints",
    "5",
    "--seed",
    "3",
    "--optimizer",
    "adafactor",
    "--lr_schedule",
    "onecycle",
    "--warmup_steps",
    "2",
    "--learning_rate",
    "2e-2",
    "--freeze",
    "transformer.h.0.*",
]


def test_adafactor_onecycle_freeze_resume_gives_the_uninterrupted_losses(tiny_flags, tmp_path, capsys):
    runs = tmp_path / "runs"
    assert run_cli("pretrain", *tiny_flags, *RUN, "--run_name", "ref") == 0
    ref = [r for r in read_jsonl(runs / "ref" / "metrics.jsonl") if "loss" in r]
    record = json.loads((runs / "ref" / "config.json").read_text())
    assert (
        record["config"]["optim"]["optimizer"] == "adafactor"
        and record["config"]["model"]["freeze"] == "transformer.h.0.*"
    )
    assert any(d["setting"] == "freeze" and "trainable" in d["reason"] for d in record["decisions"])
    summary = json.loads((runs / "ref" / "summary.json").read_text())
    assert 0 < summary["n_trainable_params"] < summary["n_params"] == record["resolved"]["n_params"]
    assert ref[0]["lr"] == pytest.approx(2e-2 / 25) and ref[1]["lr"] == pytest.approx(2e-2)  # onecycle's rise
    # a run stopped after step 2: its checkpoint at 2, then RESUME=1
    shutil.copytree(runs / "ref", runs / "cut", symlinks=True)
    for path in on_disk.list_checkpoints(runs / "cut" / "checkpoints"):
        if int(path.name.split("-")[1]) > 2:
            shutil.rmtree(path)
    capsys.readouterr()
    assert (
        run_cli("pretrain", *tiny_flags, *RUN, "--run_name", "cut", "--resume", "1", "--optimizer", "sgd")
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert "OPTIMIZER=adafactor, this run has OPTIMIZER=sgd" in err and len(err.splitlines()) == 1
    assert run_cli("pretrain", *tiny_flags, *RUN, "--run_name", "cut", "--resume", "1") == 0
    rows = [r for r in read_jsonl(runs / "cut" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    np.testing.assert_allclose([r["loss"] for r in rows], [r["loss"] for r in ref], rtol=0, atol=1e-6)
    np.testing.assert_allclose([r["lr"] for r in rows], [r["lr"] for r in ref], rtol=1e-12, atol=0)
