"""find-batch's saved answer (OUTPUT_DIR/.auto_batch.json): the settings it holds for, reading
it back, and at a run's start the note that it measured a faster micro-batch than the run's own.

The guides' numbers (the optimized preset's 32 x 4) stay the default; the kit's own measurement
is offered, not imposed: a run without AUTO_BATCH=1 says when the saved answer for this model,
length, precision and device beat the micro-batch it is about to use, and by how much, and
AUTO_BATCH=1 takes it. JSON only (never sourced or unpickled)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from train.core.device import device_name
from train.core.objective import mode_of

if TYPE_CHECKING:
    from train.run.plan.make import Plan

RESULT_FILE = ".auto_batch.json"
# Below this speed-up the note would be noise: two trials of a few steps differ by ~5 % anyway.
WORTH = 1.05


def settings_key(plan: Plan, effective: int, world_size: int) -> dict:
    """What the answer depends on; a saved result is reused only when all of it matches."""
    model_cfg = json.dumps(plan.model.config.to_dict(), sort_keys=True, default=str)
    key = {
        "model": hashlib.sha256(model_cfg.encode()).hexdigest()[:16],
        "mode": plan.cfg.run.mode,  # dpo's micro-batch counts pairs, its step holds the reference
        "reference": plan.cfg.model.reference,
        "max_length": plan.max_length,
        "precision": plan.precision,
        "gradient_checkpointing": plan.cfg.model.gradient_checkpointing,
        "compile": plan.cfg.model.compile,
        "optimizer": plan.cfg.optim.optimizer,  # its state and what FREEZE leaves trained move the peak
        "freeze": plan.cfg.model.freeze,
        # a list: as the saved JSON reads back  # adapters alone trained: a far lower peak
        "lora": [plan.cfg.model.lora_r or 0, plan.cfg.model.lora_targets],
        "device": device_name(plan.device),
        "target_vram": plan.cfg.system.target_vram,
        "max_memory_mb": plan.cfg.system.max_memory_mb,
        "effective_batch": effective,
        "world_size": world_size,
        "torch": torch.__version__,
    }
    if mode_of(plan.cfg.run.mode).sampled:  # GRPO: a prompt's rows, and how long they run, move the peak
        key["rows"] = [plan.cfg.optim.num_generations, plan.cfg.optim.max_completion_length]
    return key


def load(path: Path) -> tuple[dict | None, str]:
    try:
        saved = json.loads(path.read_text())
    except FileNotFoundError:
        return None, "no earlier result"
    except (OSError, ValueError):
        return None, f"{path} is unreadable"
    if not isinstance(saved, dict):
        return None, f"{path} is not a find-batch result"
    return saved, ""


def read_saved(path: Path, key: dict, per_rank: int) -> tuple[tuple[int, int] | None, str]:
    """A saved (batch, accumulation) if the file is valid and for these settings, else the reason."""
    saved, why = load(path)
    if saved is None:
        return None, why
    size, accum = saved.get("batch_size"), saved.get("gradient_accumulation_steps")
    whole = all(type(v) is int and v >= 1 for v in (size, accum))  # type(): bools are ints too
    if not whole or size * accum != per_rank:
        return None, f"{path} holds no valid BATCH_SIZE x GRADIENT_ACCUM = {per_rank}"
    if saved.get("key") != key:
        return None, "the mode, model, length, precision, device or budget changed since the saved result"
    return (size, accum), f"saved by find-batch at {saved.get('written', '?')} in {path}"


def _rate(trials, size: int) -> tuple[float | None, str]:
    """The measured samples/s of micro-batch `size` in the saved trials, or why there is none."""
    for t in trials if isinstance(trials, list) else []:
        if isinstance(t, dict) and t.get("batch_size") == size:
            rate = t.get("samples_per_sec")
            ok = isinstance(rate, (int, float)) and not isinstance(rate, bool) and rate > 0
            return (
                (float(rate), "") if ok and t.get("status") == "fits" else (None, str(t.get("status", "?")))
            )
    return None, "not tried"


def faster_answer(plan: Plan, world_size: int) -> str | None:
    """The note for a run about to train at the plan's micro-batch when find-batch saved a faster one
    for exactly these settings (None when there is none, or AUTO_BATCH=1 already took it)."""
    o = plan.cfg.optim
    if o.auto_batch or plan.cfg.run.mode != "pretrain":  # find-batch measures pretraining steps
        return None
    size, accum = o.batch_size, o.gradient_accumulation_steps  # as decided
    per_rank = size * accum
    path = Path(plan.cfg.run.output_dir) / RESULT_FILE
    answer, _ = read_saved(path, settings_key(plan, per_rank * world_size, world_size), per_rank)
    if answer is None or answer[0] == size:
        return None
    trials = load(path)[0].get("trials")
    theirs, _ = _rate(trials, answer[0])
    ours, why = _rate(trials, size)
    if theirs is None:
        return None
    if ours is None:
        measured = f"BATCH_SIZE={size} was {why} there"
    elif theirs < WORTH * ours:
        return None
    else:
        measured = f"{theirs / ours:.2f}x this run's {size} x {accum} ({ours:.1f} samples/s)"
    return (f"find-batch measured BATCH_SIZE={answer[0]} GRADIENT_ACCUM={answer[1]} at {theirs:.1f} "
            f"samples/s on "
            f"{device_name(plan.device)}, {measured}; AUTO_BATCH=1 takes it (effective batch kept), or set "
            "both")
