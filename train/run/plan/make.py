"""The plan of a run, decided once before anything trains: device, precision, model size,
sequence length, the effective batch and learning rate, the memory-adaptive settings, step count,
warm-up, and every automatic choice with the reason for it. One function makes it for every mode
(make_plan), in one order: the model's family and shape (config only) -> MAX_LENGTH -> the fit
check -> the tokenizer -> the data -> the model -> the memory-adaptive settings and the steps. A mode's
source (Source: pretraining's in build.py, SFT's in sft.py, preference training's in dpo.py) supplies
each of those as a pure call that returns what it made (a ModelChoice, a tokenizer, a Data, a model, the
objective): nothing is kept on the source. The plan is frozen: what changes at run time (an
out-of-memory's smaller micro-batch, a resume's position) belongs to the object that owns it.

Nothing here writes to runs/, so bad input stops before any run folder is touched.
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Protocol

import numpy as np
import torch

from config import TrainConfig
from train.config import knobs
from train.core.device import attention_kernels, resolve_device, resolve_precision, set_tf32
from train.core.errors import UsageError
from train.core.generation import apply_generation_config, read_generation_config
from train.core.objective import Objective
from train.core.optim.registry import OPTIMIZERS
from train.core.optim.schedules import warmup_of
from train.core.step import TokenObjective
from train.data.loader import Data
from train.distributed.parallel import describe
from train.distributed.process_group import SINGLE, Dist, rank_device
from train.models import estimate
from train.models.family import Family
from train.models.freeze import apply_freeze, trainable_of
from train.run.compile import choose
from train.run.plan import adapt, fill

MAX_LENGTH_CAP = 2048  # longer windows cost quadratic attention for what a small model learns
# With no GPU and no MODEL_SIZE: 8 optimizer steps of the launcher's 32, no accumulation, so that
# `make train` ends in 40 s on 2 quiet cores (tokenizer and token cache included; 1 min 35 s at load 4)
# with a falling loss and every output; 2048 samples at 32 x 4 took over 30 minutes on a loaded host.
CPU_DEMO_SAMPLES = 256


@dataclass(frozen=True)
class Plan:
    """Every decision of a run and the objects made from them; assigning to a field raises."""

    cfg: TrainConfig
    """The config as decided (the asked one is left as it was); read, never written, after planning."""
    device: torch.device
    precision: str
    model_size: str
    family: Family
    """The model's family (train/models): what differs between architectures, decided once."""
    max_length: int
    model: torch.nn.Module
    tokenizer: object
    dataset: torch.utils.data.Dataset
    total_steps: int
    warmup_steps: int
    decisions: tuple = ()
    """({"setting", "value", "reason"}, ...) in the order they were made: config.json's list."""
    world: Dist = SINGLE
    collate: Callable | None = None
    """The training batches' collator (train/data/loader.py make_loader); None: default stacking."""
    summary_extra: Mapping = field(default_factory=dict)
    """Mode-specific entries added to summary.json (SFT: data format, truncation counts...)."""
    val_dataset: torch.utils.data.Dataset | None = None
    val_collate: Callable | None = None
    """SFT: the collator for validation batches (padding); None: default stacking."""
    objective: Objective | None = None
    """The mode's objective (train/core/objective.py): its loss for train_step, its samples, log fields and
    validation. The token loss of pretraining and SFT (token_objective), preference training's
    PreferenceObjective (train/core/preference) with its reference model; made by the plan's source."""


@dataclass(frozen=True)
class ModelChoice:
    """Which model a run trains, decided from the settings and config files alone (no weights,
    no data): its family, its summary name and context, what set it."""

    family: Family
    size: str
    """summary.json's model_size: MODEL_SIZE, "custom" (MODEL_CONFIG), or a loaded model's name."""
    context: int
    variable: str
    """What chose it, for messages: MODEL_SIZE=nano, MODEL_CONFIG=..., MODEL_PATH=..."""
    demo: bool = False
    """The CPU demo (no GPU, no MODEL_SIZE): a short budget."""
    config: object = None
    """A new model's transformers config (its vocabulary sized once the tokenizer is known); a
    loaded model's, as read from MODEL_PATH."""
    path: Path | None = None
    """A saved model's folder (MODEL_PATH); None for a new model."""
    declared: Mapping = field(default_factory=dict)
    """MODEL_CONFIG's own special ids (SFT from scratch lays its BPE out at them)."""


@dataclass(frozen=True)
class Chosen:
    """A micro-batch chosen ahead of planning (AUTO_BATCH=1: find-batch), with its reason."""

    batch_size: int
    gradient_accumulation_steps: int
    reason: str


class Source(Protocol):
    """Where a mode's model, tokenizer, data and objective come from: what make_plan asks, each a pure
    call that returns what it made (nothing kept on the source). Pretraining's (build.PretrainingSource),
    SFT's (sft.SFTSource) and preference training's (dpo.DPOSource, composed of sft.py's functions)."""

    shapes_vary: bool
    """Whether batch shapes vary (padded to each batch's longest): attention_kernels' choice."""

    def refuse(self, cfg: TrainConfig) -> None:
        """A setting this mode would ignore or cannot do: one line (UsageError), before any work."""

    def choose(self, cfg: TrainConfig, device: torch.device, say, decide) -> ModelChoice:
        """The model's family and shape, from settings and config files alone."""

    def tokenizer(self, cfg: TrainConfig, choice: ModelChoice, max_length: int, say, decide):
        """The run's tokenizer."""

    def data(self, cfg: TrainConfig, choice: ModelChoice, tok, device: torch.device, precision: str,
             max_length: int, say, decide) -> Data:
        """The training and held-out data and how to batch them."""

    def model(self, cfg: TrainConfig, choice: ModelChoice, tok, data: Data, device: torch.device,
              decide) -> torch.nn.Module:
        """The model on its device, before the memory-adaptive settings."""

    def steps(self, cfg: TrainConfig, data: Data, world_size: int, say, decide) -> tuple[int, str]:
        """(optimizer steps, why)."""

    def objective(self, cfg: TrainConfig, choice: ModelChoice, model, data: Data, device: torch.device,
                  precision: str, max_length: int, trained: int, say, decide) -> tuple[Objective, Data]:
        """(the mode's objective, the data its batches come from: the same, or one whose batches carry
        more)."""

    # Optional, asked only where a source has it (getattr): fill_reference(cfg, data, world_size,
    # effective) -> the REFERENCE the fill leaves room for, where the objective decides it afterwards
    # from the room left (dpo.DPOSource's).


class Decisions:
    """Every automatic choice, printed as it is made and saved in config.json with its reason."""

    def __init__(self, say):
        self.say, self.items = say, []

    def __call__(self, setting: str, value, reason: str) -> None:
        earlier = next((d for d in self.items if d["setting"] == setting), None)
        if earlier is not None and earlier["value"] == value:
            # Confirmed by a later check (workers capped to the cores, then kept by free RAM): one
            # line said it; config.json keeps both reasons.
            earlier["reason"] += f"; {reason}"
            return
        self.items.append({"setting": setting, "value": value, "reason": reason})
        self.say(f"  {setting} = {value}  ({reason})")


def note_family_ignored(cfg: TrainConfig, say, why: str) -> None:
    """MODEL_FAMILY set where something else decides the model (MODEL_CONFIG, a loaded MODEL_PATH):
    said, not refused (the launchers pass the default through)."""
    if cfg.model.model_family != knobs.default("model_family"):
        say(f"MODEL_FAMILY={cfg.model.model_family} is ignored: {why}")


def token_objective(cfg: TrainConfig, choice: ModelChoice) -> TokenObjective:
    """The token loss of pretraining and SFT, averaged as LOSS_MEAN says: over the step's target tokens,
    or (micro_batches) the mean of its micro-batches' means. Validation and find-batch's single
    micro-batch weigh by tokens either way (TokenObjective.evaluate; one micro-batch: the same mean)."""
    micro_batches = cfg.optim.loss_mean == "micro_batches"
    return TokenObjective(choice.family.layout, micro_batch_mean=micro_batches)


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
        decide(
            "max_length", max_length, "the model's context length" + (" (capped)" if context > cap else "")
        )
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
    """The log interval and the warm-up length for a run of total_steps; returns the warm-up in
    steps (WARMUP_STEPS below 1 is a share of the run; the config keeps the share)."""
    if cfg.run.log_every is None:
        cfg.run.log_every = max(1, min(10, total_steps // 10))
        decide("log_every", cfg.run.log_every, "every 10 steps, or ~10 lines in a short run")
    warmup = cfg.optim.warmup_steps
    if warmup is None:
        warmup = min(200, max(1, total_steps // 20))
        decide("warmup_steps", warmup, "5 % of the run, at most 200")
    elif 0 < warmup < 1:
        share, warmup = warmup, warmup_of(warmup, total_steps)
        decide("warmup_steps", warmup, f"WARMUP_STEPS={share:g}: that share of the run's {total_steps} "
               f"steps, rounded up")
    own = OPTIMIZERS[cfg.optim.optimizer].own_step
    if own:
        decide("lr_schedule", own, f"OPTIMIZER={cfg.optim.optimizer} sets its own step, min(1e-2, "
                                   f"1/sqrt(step)) x "
               "each parameter's RMS: LEARNING_RATE, LR_SCHEDULE and WARMUP_STEPS are unused (the lr logged "
               "is its relative step)")
    return warmup


def sized_validation(cfg: TrainConfig, val, total_steps: int, world: Dist, decide: Decisions):
    """The held-out set a short run evaluates: no more sequences than the run trains on, so its
    end-of-run pass is not the run's longest part (a 5-step SFT run spent 67 s evaluating after 72 s
    of training). The first ones, the same for any BATCH_SIZE: runs compared on one sample budget
    evaluate the same sequences. TOKEN_BUDGET steps vary in rows, so those runs keep the whole set."""
    if val is None or cfg.data.token_budget is not None:
        return val
    trained = total_steps * cfg.effective_batch_size(world.world_size)
    if trained >= len(val):
        return val
    decide("eval_size", f"{trained} of {len(val)} held-out sequences", f"a short run: no more than the "
                                                                       f"{trained} it "
           "trains on (the first ones, the same whatever BATCH_SIZE); a longer run evaluates them all")
    if isinstance(val, torch.utils.data.Subset):  # a split of the stream: keep its indices into it
        return torch.utils.data.Subset(val.dataset, val.indices[:trained])
    return torch.utils.data.Subset(val, range(trained))


def parallel(cfg: TrainConfig, world: Dist, decide: Decisions) -> None:
    """DDP or FSDP2 sharding, where several processes (or SHARDING) are in play."""
    how = describe(world, cfg.system.sharding, cfg.system.offload_optimizer)
    if how:
        decide("parallel", cfg.system.sharding if cfg.system.sharding != "none" else "ddp", how)


def micro_batch(cfg: TrainConfig, chosen: Chosen | fill.Fill | None, choice: ModelChoice, model, data,
                max_length: int, precision: str, device, world: Dist, decide: Decisions,
                source: Source | None = None) -> None:
    """The micro-batch found ahead of planning (AUTO_BATCH=1), or, with no micro-batch of the user's,
    the one that fills a GPU (fill.py), with room for what the source's fill_reference says the run may
    still choose; else the one asked."""
    own = getattr(source, "fill_reference", None)  # the Source protocol's optional method
    if isinstance(chosen, Chosen):
        cfg.optim.batch_size, cfg.optim.gradient_accumulation_steps = (
            chosen.batch_size,
            chosen.gradient_accumulation_steps,
        )
    elif (
        isinstance(chosen, fill.Fill)
        and device.type == "cuda"
        and fill.applies(cfg.run.mode, choice.family.layout)
    ):
        fill.fill_memory(
            cfg,
            model,
            data.dataset,
            data.collate,
            max_length,
            precision,
            device,
            world.world_size,
            choice.family.layout,
            decide,
            reference_for=own and (lambda effective: own(cfg, data, world.world_size, effective)),
        )


def demo_budget(cfg: TrainConfig, choice: ModelChoice, decide: Decisions) -> None:
    """The CPU demo's budget, where the run sets no length of its own."""
    if (
        choice.demo
        and cfg.optim.max_steps is None
        and cfg.optim.epochs is None
        and cfg.optim.max_samples is None
    ):
        cfg.optim.max_samples = CPU_DEMO_SAMPLES
        decide("max_samples", CPU_DEMO_SAMPLES, "CPU demo budget, under a minute on 2 cores (set MAX_STEPS, "
                                                "EPOCHS or MAX_SAMPLES to change)")
        if cfg.optim.gradient_accumulation_steps > 1 and cfg.optim.effective_batch is None:
            cfg.optim.gradient_accumulation_steps = 1  # more, shorter steps: the loss is seen falling
            decide("gradient_accumulation_steps", 1, "CPU demo: one micro-batch per optimizer step (set "
                                                     "MAX_STEPS, EPOCHS or MAX_SAMPLES to keep "
                                                     "GRADIENT_ACCUM)")


def decide_freeze(cfg: TrainConfig, model, decide: Decisions) -> None:
    """FREEZE applied to the built model, and said."""
    frozen = apply_freeze(model, cfg.model.freeze)
    if frozen:
        decide("freeze", cfg.model.freeze, frozen)
        if cfg.model.lora_r:  # LoRA's count was decided before FREEZE took its share of the adapters
            decide("trainable_params", trainable_of(model).params, "LoRA's adapters left trained by FREEZE")


def make_plan(asked: TrainConfig, say, world: Dist, source: Source,
              chosen: Chosen | fill.Fill | None = None) -> Plan:
    """The one plan function. `source` (build.PretrainingSource, sft.SFTSource, dpo.DPOSource) answers
    where the model, tokenizer, data and loss (objective) come from, each a pure call; every other
    decision is made here, the same way for every mode. chosen: a micro-batch found ahead of
    planning (AUTO_BATCH=1), or fill.Fill: no micro-batch of the user's, so a GPU run fills the device."""
    cfg = copy.deepcopy(asked)
    knobs.refuse_unread(cfg)  # a knob its mode does not read (knob(modes=...)), set: one line, no work
    source.refuse(cfg)
    # before any work: final/'s generate() settings
    generation = read_generation_config(cfg.model.generation_config)
    decide = Decisions(say)
    device, precision = device_and_precision(cfg, world, decide)
    choose.decide_compile(cfg, device, decide)  # before the data: its padding follows COMPILE
    choice = source.choose(cfg, device, say, decide)
    if (why := attention_kernels(device, source.shapes_vary)) is not None:
        decide("attention_kernels", "flash / memory-efficient, cuDNN's off", why)
    max_length = sequence_length(cfg, choice.context, MAX_LENGTH_CAP, decide)  # before any data work
    # Every model that cannot fit, from its config alone, before anything is loaded or built (MODEL_PATH's
    # too: a config asking for 2 TB was the kernel's out-of-memory kill); not a trusted folder's own classes,
    # which only its own code can build.
    if not (
        choice.path is not None and getattr(choice.config, "auto_map", None) and cfg.model.trust_remote_code
    ):
        estimate.refuse_unfit(
            choice.config, cfg, max_length, precision, device, world.world_size, choice.variable
        )
    tok = source.tokenizer(cfg, choice, max_length, say, decide)
    data = source.data(cfg, choice, tok, device, precision, max_length, say, decide)
    # The model before the memory-adaptive settings: what they see free is what the run will have.
    model = source.model(cfg, choice, tok, data, device, decide)
    micro_batch(cfg, chosen, choice, model, data, max_length, precision, device, world, decide, source)
    # EFFECTIVE_BATCH, LR_SCALING, then workers / pin / prefetch / token cache from free memory
    adapt.adapt(cfg, device, data.dataset, decide, world.world_size, max_length=max_length)
    demo_budget(cfg, choice, decide)
    total_steps, why = source.steps(cfg, data, world.world_size, say, decide)
    decide("total_steps", total_steps, why)
    warmup = resolve_pacing(cfg, total_steps, decide)
    # before DDP / FSDP2 and the optimizer (train/models/freeze.py)
    decide_freeze(cfg, model, decide)
    apply_generation_config(model, generation, decide, cfg.model.generation_config)
    # the mode's loss, and its reference model made from the policy as it starts (preference training)
    trained = total_steps * cfg.effective_batch_size(world.world_size)
    objective, data = source.objective(cfg, choice, model, data, device, precision, max_length, trained, say,
                                       decide)
    val_dataset = sized_validation(cfg, data.val_dataset, total_steps, world, decide)
    parallel(cfg, world, decide)
    choose.decide_mode(cfg, model, choice.family, max_length, device, precision, world.world_size, decide)
    return Plan(
        cfg=cfg, device=device, precision=precision, model_size=choice.size, family=choice.family,
        max_length=max_length, model=model, tokenizer=tok, dataset=data.dataset, total_steps=total_steps,
        warmup_steps=warmup, decisions=tuple(decide.items), world=world, collate=data.collate,
        summary_extra=MappingProxyType(data.summary), val_dataset=val_dataset, val_collate=data.val_collate,
        objective=objective,
    )
