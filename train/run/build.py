"""Build everything a run needs before its folder exists: device, precision, data, model.

Nothing here writes to runs/, so bad input stops before any run folder is touched. Every
automatic choice is recorded as a decision with the reason for it.
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from config import TrainConfig
from train.core import model as model_lib
from train.core.device import resolve_device, resolve_precision, set_tf32
from train.core.errors import UsageError
from train.data import text as data
from train.dist.distributed import SINGLE, Dist, describe, rank_device
from train.run import adapt, evaluate

# With no GPU and no MODEL_SIZE, a demo sized to finish in a few minutes on 2 cores.
CPU_DEMO_SAMPLES = 2048


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


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def plan_steps(cfg: TrainConfig, n_samples: int, world_size: int = 1) -> tuple[int, str]:
    """Optimizer steps for this run: the smallest of MAX_STEPS, EPOCHS and MAX_SAMPLES."""
    effective = cfg.effective_batch_size(world_size)
    # every rank reads its own 1/world_size of the data
    per_epoch = n_samples // world_size // cfg.optim.batch_size // cfg.optim.gradient_accumulation_steps
    if per_epoch == 0:
        processes = " x processes" if world_size > 1 else ""
        raise UsageError(
            f"DATA_PATH: {n_samples} sequences of MAX_LENGTH tokens are fewer than one optimizer step "
            f"needs ({effective} = BATCH_SIZE x GRADIENT_ACCUM{processes}); add data or lower those"
        )
    steps, source = shortest_limit(cfg, per_epoch, effective)
    return steps, f"{source}; one epoch is {per_epoch} steps of {effective} sequences"


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


def resolve_pacing(cfg: TrainConfig, total_steps: int, decide) -> int:
    """The log interval and the warm-up length for a run of total_steps; returns the warm-up."""
    if cfg.run.log_every is None:
        cfg.run.log_every = max(1, min(10, total_steps // 10))
        decide("log_every", cfg.run.log_every, "every 10 steps, or ~10 lines in a short run")
    warmup = cfg.optim.warmup_steps
    if warmup is None:
        warmup = min(200, max(1, total_steps // 20))
        decide("warmup_steps", warmup, "5 % of the run, at most 200")
    return warmup


def build(cfg: TrainConfig, say, world: Dist = SINGLE) -> Built:
    from train.run.sft import build_sft, refuse_sft_settings

    if cfg.run.mode == "sft":
        return build_sft(cfg, say, world)
    refuse_sft_settings(cfg)
    decisions = []

    def decide(setting: str, value, reason: str) -> None:
        decisions.append({"setting": setting, "value": value, "reason": reason})
        say(f"  {setting} = {value}  ({reason})")

    device, why = rank_device(*resolve_device(cfg.system.device), world)
    decide("device", str(device), why)
    precision, why = resolve_precision(cfg.system.precision, device)
    decide("precision", precision, why)
    set_tf32(cfg.system.tf32)
    seed_everything(cfg.system.seed)

    model_size = cfg.model.model_size
    demo = False
    if cfg.model.model_config is not None:
        model_size = "custom"
        decide("model_size", model_size, f"MODEL_CONFIG={cfg.model.model_config}")
    elif model_size is None:
        demo = device.type == "cpu"
        model_size = "nano" if demo else "small"
        reason = (
            "no GPU: the nano model for a short CPU demo (set MODEL_SIZE to train another size)"
            if demo
            else "default on a GPU (GPT-2 small)"
        )
        decide("model_size", model_size, reason)
        if demo:
            say("No GPU found: running the nano model as a short CPU demo (set MODEL_SIZE to choose).")

    # The model's shape first (vocab set once the tokenizer is known): a MAX_LENGTH longer than
    # its context stops here, before any data work.
    hf_cfg = model_lib.build_config(model_size, cfg.model.model_config, cfg.data.vocab_size, 0)
    context = model_lib.context_length(hf_cfg)
    max_length = cfg.data.max_length
    if max_length is None:
        max_length = min(context, 2048)
        decide("max_length", max_length, "the model's context length" + (" (capped)" if context > 2048 else ""))
    elif max_length > context:
        raise UsageError(f"MAX_LENGTH={max_length}: longer than the model's context ({context} tokens)")

    cache_dir = Path(cfg.data.cache_dir)
    files = data.corpus_files(cfg.data.data_path)
    key = data.corpus_fingerprint(files)
    tok = data.load_tokenizer(cfg.data.tokenizer_path, files, key, cfg.data.vocab_size, cache_dir, say)
    tokens = data.token_cache(files, key, tok, cache_dir, say)

    hf_cfg.vocab_size = model_lib.padded_vocab(len(tok))
    if hf_cfg.vocab_size != len(tok):
        decide("vocab_size", hf_cfg.vocab_size, f"tokenizer's {len(tok)} padded to a multiple of 64")
    hf_cfg.bos_token_id = hf_cfg.eos_token_id = tok.convert_tokens_to_ids(tok.eos_token)

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if cfg.data.num_workers > cores:
        decide("num_workers", cores, f"NUM_WORKERS={cfg.data.num_workers} but only {cores} CPU cores: more workers only contend")
        cfg.data.num_workers = cores
    dataset = data.PackedDataset(tokens, max_length)
    dataset, val_dataset = evaluate.split_pretraining(cfg, dataset, tok, cache_dir, max_length, say, decide)
    # EFFECTIVE_BATCH, LR_SCALING, then workers / pin / prefetch / token cache from free memory
    adapt.adapt(cfg, device, dataset, decide)
    if demo and cfg.optim.max_steps is None and cfg.optim.epochs is None and cfg.optim.max_samples is None:
        cfg.optim.max_samples = CPU_DEMO_SAMPLES
        decide("max_samples", CPU_DEMO_SAMPLES, "CPU demo budget (set MAX_STEPS, EPOCHS or MAX_SAMPLES to change)")
    total_steps, why = plan_steps(cfg, len(dataset), world.world_size)
    decide("total_steps", total_steps, why)
    warmup = resolve_pacing(cfg, total_steps, decide)

    if cfg.run.dry_run:
        with torch.device("meta"):  # shapes and parameter count only: nothing allocated anywhere
            model = model_lib.build_model(hf_cfg, cfg.model.gradient_checkpointing, cfg.system.seed)
    else:
        model = model_lib.build_model(hf_cfg, cfg.model.gradient_checkpointing, cfg.system.seed).to(device)
    parallel = describe(world, cfg.system.sharding, cfg.system.offload_optimizer)
    if parallel:
        decide("parallel", cfg.system.sharding if cfg.system.sharding != "none" else "ddp", parallel)
    return Built(
        cfg=cfg,
        device=device,
        precision=precision,
        model_size=model_size,
        max_length=max_length,
        model=model,
        tokenizer=tok,
        dataset=dataset,
        total_steps=total_steps,
        warmup_steps=warmup,
        decisions=decisions,
        world=world,
        val_dataset=val_dataset,
    )
