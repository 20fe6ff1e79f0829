"""DRY_RUN=1 (--dry_run, `make show-config`): check the settings before launching.

Prints the resolved config, the derived numbers and a peak-memory estimate, then exits. The
model is built on the meta device (shapes only), so nothing is allocated on the GPU, and no
run folder is created. The tokenizer and the token cache are built or reused, because the
steps per epoch depend on the number of tokens; that cache is the same one a real run uses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from train.core.errors import UsageError
from train.core.model import count_params
from train.core.units import MIB
from train.models.estimate import estimate_for_run
from train.models.flops import model_flops_per_token, sample_lengths
from train.models.freeze import trainable_of
from train.run.plan.adapt import over_memory, row_shape
from train.run.rundir.report import config_lines

if TYPE_CHECKING:
    from train.run.plan.fill import Fill
    from train.run.plan.make import Plan

NEAR_FULL = 0.9  # above this share of the GPU's memory a run is likely to hit OOM


def derived_numbers(plan: Plan) -> dict:
    """The numbers a user checks before launching, from a built (meta-device) run."""
    cfg, o = plan.cfg, plan.cfg.optim
    n_params = count_params(plan.model)
    effective = cfg.effective_batch_size()
    per_step = effective * tokens_per_sample(plan)  # an encoder-decoder: source + target tokens
    return {
        "n_params": n_params,
        "effective_batch_size": effective,
        "tokens_per_step": per_step,
        "train_sequences": len(plan.dataset),
        "val_sequences": None if plan.val_dataset is None else len(plan.val_dataset),
        "steps_per_epoch": len(plan.dataset) // o.batch_size // o.gradient_accumulation_steps,
        "total_steps": plan.total_steps,
        "warmup_steps": plan.warmup_steps,
        "samples": plan.total_steps * effective,
        "tokens": plan.total_steps * per_step,
        "flops_per_token": model_flops_per_token(plan.model, *run_lengths(plan)),
    }


def run_lengths(plan: Plan) -> tuple[int, int | None]:
    """(window, None) for a causal LM; (source, target) for an encoder-decoder."""
    return sample_lengths(plan.family, plan.cfg.run.mode, plan.max_length)


def tokens_per_sample(plan: Plan) -> int:
    """Tokens one sample counts for tokens/s: its window, or source + target (worst case)."""
    source, target = run_lengths(plan)
    return source + (target or 0)


def device_total_mb(device) -> float | None:
    """The GPU's memory from its properties (no allocation), or None off CUDA."""
    if device.type != "cuda":
        return None
    import torch

    return torch.cuda.get_device_properties(device).total_memory / MIB


def dry_run(cfg, say, chosen: Fill | None = None) -> int:
    """chosen: fill.Fill where no BATCH_SIZE is the user's, so that on a GPU the micro-batch shown is the
    one the real run fills the device with (train/run/plan/fill.py), not the preset's."""
    from train.run.plan.build import build
    from train.run.rundir.claim import plan_run_dir

    say(
        f"{cfg.run.mode}: dry run (DRY_RUN=1): settings, derived numbers and a memory estimate; nothing "
        f"trains"
    )
    try:
        run_path = plan_run_dir(cfg.run.output_dir, cfg.run.run_name, cfg.run.launcher, cfg.run.overwrite)
        where = f"a real run would write {run_path}/"
    except UsageError as err:
        where = f"warning: a real run would stop here: {err}"
    plan = build(cfg, say, chosen=chosen)
    cfg = plan.cfg  # as decided
    say("resolved config:")
    for line in config_lines(cfg, plan):
        say(line)
    n = derived_numbers(plan)
    o = cfg.optim
    val = "off" if n["val_sequences"] is None else f"{n['val_sequences']:,}"
    say(
        f"model {plan.model_size}: {n['n_params']:,} parameters ({n['n_params'] / 1e6:.1f}M), "
        f"max_length {plan.max_length}, device {plan.device}, precision {plan.precision}"
    )
    say(
        f"effective batch {n['effective_batch_size']} = BATCH_SIZE {o.batch_size} x GRADIENT_ACCUM "
        f"{o.gradient_accumulation_steps} x 1 GPU; {n['tokens_per_step']:,} tokens per optimizer step"
    )
    say(
        f"data: {n['train_sequences']:,} training sequences, validation {val}; "
        f"{n['steps_per_epoch']:,} steps per epoch"
    )
    say(
        f"plan: {n['total_steps']:,} optimizer steps ({n['warmup_steps']} warm-up), "
        f"{n['samples']:,} samples, {n['tokens']:,} tokens, {n['flops_per_token'] / 1e9:.2f} GFLOPs per token"
    )
    # the data's rows
    shape = row_shape(plan.dataset, plan.collate, plan.max_length, cfg.run.mode, plan.family.layout)
    est = estimate_for_run(
        plan.model.config,
        n["n_params"],
        cfg,
        shape["max_length"],
        plan.precision,
        plan.device.type,
        trainable=trainable_of(plan.model),
        target_length=shape.get("target_length"),
        packed=shape.get("packed"),
    )
    say("peak device memory estimate:")
    for line in describe(est):
        say(line)
    # over the device's memory: warned; the fit check in build() refused what cannot fit
    warning = over_memory(plan)
    if warning:
        say(warning)
    total = device_total_mb(plan.device)
    if total and not warning:
        share = est["peak"] / MIB / total
        say(f"  that is {share:.0%} of this GPU's {total:,.0f} MB")
        if share > NEAR_FULL:
            say(
                "warning: likely out of memory; lower BATCH_SIZE and raise GRADIENT_ACCUM (same effective "
                "batch), or set ENABLE_GRAD_CKPT=1 or ENABLE_BF16=1"
            )
    say(where)
    say(
        f"dry run: no model on the device, no run folder; the token cache in {cfg.data.cache_dir} was reused "
        f"or built"
    )
    return 0


def describe(estimate: dict) -> list[str]:
    """The estimate as console lines, in MiB."""

    def mb(key):
        return f"{estimate[key] / MIB:,.0f} MB"

    lines = [] if "source_length" not in estimate else [
        f"  encoder-decoder: source {estimate['source_length']} tokens, target {estimate['target_length']} "
        f"tokens"
    ]
    lines += [
        f"  weights (fp32 master) {mb('weights')}, autocast copies {mb('weight_copies')}, "
        f"gradients {mb('gradients')}, optimizer state {mb('optimizer')}"
        + (f", cuBLAS workspaces {mb('workspace')}" if estimate.get("workspace") else ""),
        f"  activations at the peak {mb('activations')} (of which loss/logits {mb('loss_logits')}; "
        f"{mb('activations_per_layer')} per layer)",
    ]
    if "kv_cache" in estimate:  # a sampled mode's (GRPO's): its generation's cache, before the forwards
        lines.append(f"  sampling's KV cache {mb('kv_cache')} (BATCH_SIZE x NUM_GENERATIONS rows at the "
                     f"longest prompt + MAX_COMPLETION_LENGTH)")
    lines += [
        f"  estimated peak {mb('peak')} (torch max_memory_allocated; the CUDA context and the "
        "allocator's cache come on top)",
    ]
    return lines
