"""OPTIMIZER: one entry per name in OPTIMIZERS, with its builder and what the rest of the kit asks
of it (its state's bytes for the memory estimate, whether it steps FSDP2's sharded parameters,
whether it sets its own step size). build_optimizer is the one builder the trainer, find-batch,
autotune and the benches share. A new optimizer is an entry here: config.py's OPTIMIZERS are these
names. torch is imported inside the builders: config.py reads this table, and the launchers'
knob lists read config.py without paying for torch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from train.core.errors import UsageError
from train.core.optim.schedules import Schedule


@dataclass(frozen=True)
class Optimizer:
    """One OPTIMIZER. build(param groups, lr) -> (torch optimizer, how it runs, for the log).
    state_bytes(trainable params, factored state elements or None) -> (state, the step's own
    temporaries) in bytes (train/models/estimate.py). factored: its state per matrix is a
    row and a column (the estimate needs the shapes). shards: it can step FSDP2's sharded
    parameters (SHARDING=zero2|zero3). own_step: the curve of schedules.CURVES it steps by,
    whatever LEARNING_RATE and LR_SCHEDULE say (None: it takes the schedule's lr)."""

    build: Callable
    doc: str
    state_bytes: Callable[[int, int | None], tuple[int, int]]
    factored: bool = False
    shards: bool = True
    own_step: str | None = None


def _fused_or_foreach(klass, groups, lr: float, how: dict, label: str, fused: bool = True):
    """Fused (one kernel for all parameters) where the device has it, which saves the
    per-parameter launch overhead of the for-loop version; on CPU too (bench/RESULTS.md): nano's
    AdamW step takes 4.9 ms fused vs 18.3 foreach, 17.2 for-loop."""
    if fused:
        try:
            return klass(groups, lr=lr, fused=True, **how), label.format("fused")
        except (RuntimeError, TypeError):
            pass
    return klass(groups, lr=lr, foreach=True, **how), label.format("foreach")


def _adamw(groups, lr: float):
    import torch

    return _fused_or_foreach(torch.optim.AdamW, groups, lr, {"betas": (0.9, 0.95)}, "AdamW ({})")


def _sgd(groups, lr: float):
    import torch
    from torch.distributed.tensor import DTensor

    # FSDP2's parameters are DTensors, which torch's fused SGD kernel does not take (fused AdamW does)
    sharded = any(isinstance(p, DTensor) for group in groups for p in group["params"])
    return _fused_or_foreach(torch.optim.SGD, groups, lr, {"momentum": 0.9, "nesterov": True},
                             "SGD (momentum 0.9, Nesterov, {})", fused=not sharded)  # fmt: skip


def _adafactor(groups, lr: float):
    import torch

    # one kernel per op over all
    return torch.optim.Adafactor(groups, lr=lr, foreach=True), "Adafactor (foreach)"


def _adafactor_relative(groups, lr: float):
    from train.core.optim.adafactor import RelativeAdafactor

    return RelativeAdafactor(groups), "Adafactor (relative step, parameter scaling; LEARNING_RATE unused)"


def _factored_bytes(params: int, factored: int | None) -> tuple[int, int]:
    # the step holds an fp32 update the size of what it steps: every matrix at once for torch's
    # foreach; one matrix at a time (about three of it) for the kit's loop, so 4 x params bounds both
    return 4 * (params if factored is None else factored), 4 * params


OPTIMIZERS = {
    "adamw": Optimizer(_adamw, "AdamW, betas (0.9, 0.95), fused; 2 fp32 states per parameter",
                       lambda params, factored: (8 * params, 0)),
    "adafactor": Optimizer(
        _adafactor, "torch's Adafactor (foreach): factored second moment (rows + columns of each matrix), "
                    "its lr "
        "the schedule's, the cap of its relative step, scaled by each matrix's RMS; it reads two norms per "
        "parameter on the host each step (torch's code), so on a GPU it syncs where AdamW does not",
        _factored_bytes, factored=True, shards=False),
    "sgd": Optimizer(_sgd, "SGD, momentum 0.9, Nesterov; 1 state per parameter",
                     lambda params, factored: (4 * params, 0)),
    "adafactor_relative": Optimizer(
        _adafactor_relative, "Shazeer & Stern's Adafactor with relative step and parameter scaling "
                             "(transformers' "
        "Adafactor(lr=None, relative_step=True, scale_parameter=True, warmup_init=False), ChatLM's "
        "optimizer): "
        "each step is min(1e-2, 1/sqrt(step)) x the parameter's RMS, so LEARNING_RATE and LR_SCHEDULE are "
        "unused",
        _factored_bytes, factored=True, shards=False, own_step="relative"),
}


def check_sharding(name: str, sharding: str) -> None:
    """OPTIMIZER with SHARDING: refused in one line where the optimizer cannot step sharded parameters."""
    if not OPTIMIZERS[name].shards and sharding != "none":  # Adafactor's norms need whole matrices
        raise UsageError(f"OPTIMIZER={name} and SHARDING={sharding}: it cannot step FSDP2's sharded "
                         f"parameters; use OPTIMIZER=adamw or sgd, or SHARDING=none")


def build_optimizer(optim, model, device):
    """(optimizer, how it runs) from the optimizer section (config.OptimConfig: OPTIMIZER,
    LEARNING_RATE, WEIGHT_DECAY) through its OPTIMIZERS entry. Only parameters that require grad
    (FREEZE leaves the rest out: no state for them). Decay on matrices only."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": optim.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return OPTIMIZERS[optim.optimizer].build(groups, optim.learning_rate)


def build_schedule(optim, effective: int, warmup_steps: int, total_steps: int) -> Schedule:
    """The LR schedule from the optimizer section (config.OptimConfig: LEARNING_RATE,
    MIN_LR_RATIO, LR_SCHEDULE) and the plan's steps of `effective` samples, beside build_optimizer.
    An optimizer that sets its own step size (OPTIMIZERS' own_step: adafactor_relative) gets that
    curve instead, so the logged lr is the step size it takes."""
    shape = OPTIMIZERS[optim.optimizer].own_step or optim.lr_schedule
    e = effective
    return Schedule(e, warmup_steps * e, total_steps * e, optim.learning_rate, optim.min_lr_ratio, shape)
