"""The plan of a run, decided before anything trains: device, precision, model size, sequence
length, step count, warm-up, and every automatic choice with the reason for it. build.py (a
pretraining run) and sft.py (a fine-tuning run) make it through the same steps below; the
objects it needs (model, tokenizer, data) travel with it in Built.

Nothing here writes to runs/, so bad input stops before any run folder is touched.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from config import TrainConfig
from train.core.device import resolve_device, resolve_precision, set_tf32
from train.core.errors import UsageError
from train.dist.distributed import SINGLE, Dist, rank_device
from train.dist.parallel import describe


@dataclass
class Built:
    cfg: TrainConfig
    device: torch.device
    precision: str
    model_size: str
    max_length: int
    model: torch.nn.Module
    tokenizer: object
    dataset: torch.utils.data.Dataset
    total_steps: int
    warmup_steps: int
    decisions: list = field(default_factory=list)
    world: Dist = SINGLE
    make_loader: Callable | None = None
    """SFT: (Built) -> (loader, sampler); None: the packed pretraining loader."""
    summary_extra: dict = field(default_factory=dict)
    """Mode-specific entries added to summary.json (SFT: data format, truncation counts...)."""
    val_dataset: torch.utils.data.Dataset | None = None
    val_collate: Callable | None = None
    """SFT: the collator for validation batches (padding); None: default stacking."""


class Decisions:
    """Every automatic choice, printed as it is made and saved in config.json with its reason."""

    def __init__(self, say):
        self.say, self.items = say, []

    def __call__(self, setting: str, value, reason: str) -> None:
        self.items.append({"setting": setting, "value": value, "reason": reason})
        self.say(f"  {setting} = {value}  ({reason})")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def device_and_precision(cfg: TrainConfig, world: Dist, decide: Decisions) -> tuple[torch.device, str]:
    """This rank's device and the precision it runs; TF32 and the seeds set for the run."""
    device, why = rank_device(*resolve_device(cfg.system.device), world)
    decide("device", str(device), why)
    precision, why = resolve_precision(cfg.system.precision, device)
    decide("precision", precision, why)
    set_tf32(cfg.system.tf32)
    seed_everything(cfg.system.seed)
    return device, precision


def sequence_length(cfg: TrainConfig, context: int, cap: int, decide: Decisions) -> int:
    """MAX_LENGTH, or the model's context (at most `cap`); longer than the context stops here."""
    max_length = cfg.data.max_length
    if max_length is None:
        max_length = min(context, cap)
        decide("max_length", max_length, "the model's context length" + (" (capped)" if context > cap else ""))
    elif max_length > context:
        raise UsageError(f"MAX_LENGTH={max_length}: longer than the model's context ({context} tokens)")
    return max_length


def shortest_limit(cfg: TrainConfig, per_epoch: int, per_step: float) -> tuple[int, str]:
    """(steps, the variable that set them): the smallest of MAX_STEPS, EPOCHS and MAX_SAMPLES,
    one epoch when none is set. per_step: samples one optimizer step takes (all ranks)."""
    o = cfg.optim
    limits = {}
    if o.max_steps is not None:
        limits["MAX_STEPS"] = o.max_steps
    if o.epochs is not None:
        limits["EPOCHS"] = max(1, math.ceil(o.epochs * per_epoch))
    if o.max_samples is not None:
        limits["MAX_SAMPLES"] = max(1, math.ceil(o.max_samples / per_step))
    if not limits:
        limits["EPOCHS (default 1)"] = per_epoch
    source = min(limits, key=limits.get)
    return limits[source], source


def resolve_pacing(cfg: TrainConfig, total_steps: int, decide: Decisions) -> int:
    """The log interval and the warm-up length for a run of total_steps; returns the warm-up."""
    if cfg.run.log_every is None:
        cfg.run.log_every = max(1, min(10, total_steps // 10))
        decide("log_every", cfg.run.log_every, "every 10 steps, or ~10 lines in a short run")
    warmup = cfg.optim.warmup_steps
    if warmup is None:
        warmup = min(200, max(1, total_steps // 20))
        decide("warmup_steps", warmup, "5 % of the run, at most 200")
    return warmup


def parallel(cfg: TrainConfig, world: Dist, decide: Decisions) -> None:
    """DDP or FSDP2 sharding, where several processes (or SHARDING) are in play."""
    how = describe(world, cfg.system.sharding, cfg.system.offload_optimizer)
    if how:
        decide("parallel", cfg.system.sharding if cfg.system.sharding != "none" else "ddp", how)
