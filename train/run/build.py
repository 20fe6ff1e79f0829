"""Build everything a pretraining run needs before its folder exists: the plan (train/run/plan.py)
and the objects it needs (tokenizer, token cache, model). `build` picks SFT's builder for
`python -m train sft` (train/run/sft.py). Nothing here writes to runs/."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import torch

from config import TrainConfig
from train.core import estimate
from train.core import model as model_lib
from train.core.errors import UsageError
from train.data import text as data
from train.dist.distributed import SINGLE, Dist
from train.run import adapt, evaluate
from train.run.plan import (
    Built,
    Decisions,
    device_and_precision,
    parallel,
    resolve_pacing,
    sequence_length,
    shortest_limit,
)
from train.run.sft import build_sft, refuse_sft_settings

# With no GPU and no MODEL_SIZE, a demo sized to finish in a few minutes on 2 cores.
CPU_DEMO_SAMPLES = 2048
MAX_LENGTH_CAP = 2048  # longer windows cost quadratic attention for what a small model learns


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


def build(asked: TrainConfig, say, world: Dist = SINGLE) -> Built:
    """The plan and the objects of a run. `asked` is left as it is: what was decided (adapted
    workers, derived accumulation, the demo budget ...) is in Built.cfg and Built.decisions."""
    cfg = copy.deepcopy(asked)
    if cfg.run.mode == "sft":
        return build_sft(cfg, say, world)
    refuse_sft_settings(cfg)
    decide = Decisions(say)
    device, precision = device_and_precision(cfg, world, decide)
    model_size, demo = choose_model_size(cfg, device, say, decide)
    # The model's shape first (vocab set once the tokenizer is known): a MAX_LENGTH longer than
    # its context stops here, before any data work.
    hf_cfg = model_lib.build_config(model_size, cfg.model.model_config, cfg.data.vocab_size, 0)
    max_length = sequence_length(cfg, model_lib.context_length(hf_cfg), MAX_LENGTH_CAP, decide)
    # From the config alone, before the data work and before anything is allocated.
    variable = f"MODEL_CONFIG={cfg.model.model_config}" if cfg.model.model_config else f"MODEL_SIZE={model_size}"
    estimate.refuse_unfit(hf_cfg, cfg, max_length, precision, device, world.world_size, variable)
    tok, dataset, val_dataset = pretraining_data(cfg, hf_cfg, max_length, say, decide)
    # EFFECTIVE_BATCH, LR_SCALING, then workers / pin / prefetch / token cache from free memory
    adapt.adapt(cfg, device, dataset, decide, world.world_size)
    if demo and cfg.optim.max_steps is None and cfg.optim.epochs is None and cfg.optim.max_samples is None:
        cfg.optim.max_samples = CPU_DEMO_SAMPLES
        decide("max_samples", CPU_DEMO_SAMPLES, "CPU demo budget (set MAX_STEPS, EPOCHS or MAX_SAMPLES to change)")
    total_steps, why = plan_steps(cfg, len(dataset), world.world_size)
    decide("total_steps", total_steps, why)
    warmup = resolve_pacing(cfg, total_steps, decide)
    model = make_model(cfg, hf_cfg, device)
    parallel(cfg, world, decide)
    return Built(
        cfg=cfg, device=device, precision=precision, model_size=model_size, max_length=max_length,
        model=model, tokenizer=tok, dataset=dataset, total_steps=total_steps, warmup_steps=warmup,
        decisions=decide.items, world=world, val_dataset=val_dataset,
    )


def choose_model_size(cfg: TrainConfig, device: torch.device, say, decide) -> tuple[str, bool]:
    """MODEL_SIZE, "custom" for MODEL_CONFIG, or the default: GPT-2 small on a GPU, the nano
    model as a short demo on a CPU. Returns (size, demo)."""
    if cfg.model.model_config is not None:
        decide("model_size", "custom", f"MODEL_CONFIG={cfg.model.model_config}")
        return "custom", False
    if cfg.model.model_size is not None:
        return cfg.model.model_size, False
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
    return model_size, demo


def pretraining_data(cfg: TrainConfig, hf_cfg, max_length: int, say, decide):
    """Tokenizer, token cache and the packed train / held-out datasets; sets the model's vocab
    and special tokens from the tokenizer. Returns (tokenizer, dataset, val_dataset)."""
    cache_dir = Path(cfg.data.cache_dir)
    d = cfg.data
    files = data.corpus_files(d.data_path)
    key = data.corpus_fingerprint(files, d.text_field)
    tok = data.load_tokenizer(d.tokenizer_path, files, key, d.vocab_size, cache_dir, say, d.text_field, d.tokenizer_sample_mb)
    tokens = data.token_cache(files, key, tok, cache_dir, say, d.text_field, d.tokenize_workers)
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
    return tok, dataset, val_dataset


def make_model(cfg: TrainConfig, hf_cfg, device: torch.device) -> torch.nn.Module:
    if cfg.run.dry_run:
        with torch.device("meta"):  # shapes and parameter count only: nothing allocated anywhere
            return model_lib.build_model(hf_cfg, cfg.model.gradient_checkpointing, cfg.system.seed)
    return model_lib.build_model(hf_cfg, cfg.model.gradient_checkpointing, cfg.system.seed).to(device)
