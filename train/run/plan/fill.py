"""The micro-batch that fills the GPU by itself: with neither BATCH_SIZE nor TOKEN_BUDGET set by the
user, an SFT, DPO, GRPO or T5 run on CUDA takes the largest micro-batch whose estimated peak
(train/models/estimate.py, at the longest rows the data gives) is at most TARGET_VRAM of the memory
the run can use (adapt.capacity_mb: free VRAM plus what this process holds, or MAX_MEMORY_MB), and
the gradient accumulation that keeps the effective batch, as close as whole numbers allow. Both are
decisions with their numbers, in the plan. GRPO's micro-batch counts prompts, each NUM_GENERATIONS rows
of the longest prompt + MAX_COMPLETION_LENGTH (COMPILE's widest bucket), with sampling's KV cache and,
where BETA > 0 takes one, the reference copy counted. AUTO_BATCH=1 (find-batch) measures instead of
estimating; an out-of-memory error still halves the micro-batch (train/run/loop/oom.py), the safety net.

"Set by the user": a flag on the command line, except the value a launcher passes as its own
default (`BATCH_SIZE=${BATCH_SIZE:-16}`): a variable the user set reaches the run in its
environment (the launchers export a micro-batch given as their first argument), the launcher's
default does not.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from train.core.units import MIB
from train.models.estimate_terms import PackedGrid
from train.run.plan import adapt


@dataclass(frozen=True)
class Fill:
    """The command line's word to the plan (batch_set_by_user is False): fill the device, where it is a
    GPU."""


SEARCH_LIMIT = 1 << 16  # micro-batches searched above the effective batch, to say what memory would allow


def applies(mode: str, layout) -> bool:
    """SFT, DPO, GRPO and an encoder-decoder's pretraining (T5); GPT-2 pretraining keeps its preset (the
    layout's fills)."""
    return layout.fills(mode)


def batch_set_by_user(command: str, argv: list[str], cfg, environ: Mapping[str, str]) -> bool:
    """Whether BATCH_SIZE (or TOKEN_BUDGET, AUTO_BATCH) is the user's: the module doc's rule."""
    from train.config.flags import training_parser
    from train.run.rundir.report import launcher_defaults

    if cfg.optim.auto_batch or cfg.data.token_budget is not None:
        return True
    if training_parser(command).parse_args(argv).batch_size is None:  # the preset's or config.py's
        return False
    if environ.get("BATCH_SIZE"):  # set and not empty (BATCH_SIZE= ./launcher.sh is the launcher's default)
        return True
    launcher = (cfg.run.launcher or "").rsplit("-", 1)[-1]  # KIT_MADE_BY's prefix (make compare) aside
    default = launcher_defaults(launcher).get("BATCH_SIZE") if launcher else None
    return default is None or not default.isdigit() or int(default) != cfg.optim.batch_size


def estimated_fit(cfg, model, dataset, collate, max_length: int, precision: str, device_type: str, world: int,
                  layout, target: float, per_rank: int, reference: str | None = None):
    """(the largest micro-batch whose estimated peak is at most `target` bytes, 0 if none; the peak at a
    micro-batch; the rows it is estimated at). Searched up to the data's rows or per_rank, whichever is
    more, with accumulation (held gradients) counted below per_rank. reference: the REFERENCE to size for
    where the run decides it after the micro-batch (the mode's fill_reference); else cfg's."""
    from train.core.model import count_params
    from train.models.estimate import estimate_for_run
    from train.models.freeze import trainable_of

    shape = adapt.row_shape(dataset, collate, max_length, cfg.run.mode, layout)
    n_params, trainable = count_params(model), trainable_of(model)
    sized = copy.deepcopy(cfg)
    if reference is not None:
        sized.model.reference = reference

    def peak(batch: int) -> float:
        sized.optim.batch_size, sized.optim.gradient_accumulation_steps = batch, 1 if batch >= per_rank else 2
        return estimate_for_run(
            model.config,
            n_params,
            sized,
            shape["max_length"],
            precision,
            device_type,
            world,
            trainable,
            target_length=shape.get("target_length"),
            packed=shape.get("packed"),
        )["peak"]

    return _largest(peak, target, max(per_rank, len(dataset))), peak, shape


def fill_memory(
    cfg,
    model,
    dataset,
    collate,
    max_length: int,
    precision: str,
    device: torch.device,
    world: int,
    layout,
    decide,
    capacity: tuple[float | None, str] | None = None,
    reference_for: Callable[[int], str | None] | None = None,
) -> bool:
    """Set cfg.optim's batch_size and gradient_accumulation_steps to fill the device (module doc) and
    decide them with their reasons; False where the memory the run can use is unknown. capacity:
    (MB, where the number comes from), default adapt.capacity_mb's. reference_for(effective batch): the
    REFERENCE the run may still choose, to leave room for (a mode's fill_reference: DPO's copy)."""
    o = cfg.optim
    cap_mb, what = (capacity if capacity is not None
                    else _capacity(device, cfg.system.max_memory_mb, world, cfg.run.dry_run))
    if cap_mb is None:
        return False
    effective = o.effective_batch or o.batch_size * o.gradient_accumulation_steps * world
    per_rank = max(1, math.ceil(effective / world))
    reference = reference_for(effective) if reference_for is not None else None
    allowed, peak, shape = estimated_fit(
        cfg,
        model,
        dataset,
        collate,
        max_length,
        precision,
        device.type,
        world,
        layout,
        cfg.system.target_vram * cap_mb * MIB,
        per_rank,
        reference,
    )
    rows = len(getattr(dataset, "dataset", dataset)) // world or 1
    batch, accum, note = _split(max(1, min(allowed, per_rank, rows)), per_rank, o.effective_batch, world)
    o.batch_size, o.gradient_accumulation_steps = batch, accum
    at = peak(batch) / MIB
    if "target_length" in shape:
        lengths = f"source {shape['max_length']} / target {shape['target_length']} tokens"
    elif "completion_length" in shape:  # a sampled mode's (GRPO's): BATCH_SIZE counts prompts
        prompt, room = shape["prompt_length"], shape["completion_length"]
        lengths = (f"prompts, {cfg.optim.num_generations} rows each of {shape['max_length']} tokens: the "
                   f"longest prompt {prompt} + MAX_COMPLETION_LENGTH {room}")
    else:
        lengths = f"rows of {shape['max_length']} tokens"
    if isinstance(shape.get("packed"), PackedGrid):
        g = shape["packed"]
        lengths += f", packed: {g.per_row:.1f} conversations a row, the longest {g.longest}"
    why = (f"BATCH_SIZE not set: estimated peak {at:,.0f} MB at {batch} ({lengths}) = {at / cap_mb:.0%} of "
           f"{cap_mb:,.0f} MB ({what}); TARGET_VRAM={cfg.system.target_vram:g} allows "
           + (f"{allowed}" if allowed > 0 else "none (even 1 is over it; out-of-memory recovery is the net)"))
    if reference is not None:
        why += f" with room for REFERENCE={reference}, which the run may still choose (REFERENCE empty)"
    if allowed > per_rank:
        why += f", more than the effective batch {effective} needs"
    if allowed > rows and rows < per_rank:
        unit = "prompts" if "completion_length" in shape else "rows"
        why += f"; the data gives only {rows} {unit} per process an epoch"
    decide("batch_size", batch, why)
    decide("gradient_accumulation_steps", accum, f"effective batch {effective}: " + note)
    return True


def _capacity(device: torch.device, max_memory_mb: int | None, world: int,
              dry_run: bool = False) -> tuple[float | None, str]:
    """adapt.capacity_mb's free memory with one process. With several, every rank must take the same
    micro-batch, and the plan is made on each rank in turn (distributed.main_first), where a collective
    would meet another rank's: the card's whole memory (or MAX_MEMORY_MB), the same on every rank. A dry
    run reads the card's properties too: free memory would need a CUDA context, which it never makes."""
    from train.core.device import memory_capacity

    if world == 1 and not dry_run:
        return adapt.capacity_mb(device, max_memory_mb)
    cap, what = memory_capacity(device, max_memory_mb)
    note = "the same on every rank" if world > 1 else "DRY_RUN: its whole memory; a run reads the free VRAM"
    return (None if cap is None else cap / MIB), f"{what}, {note}"


def _largest(peak, target: float, upper: int) -> int:
    """The largest micro-batch in 1..upper (up to SEARCH_LIMIT) whose peak is at most target; 0 if none.
    The estimate grows with the batch: doubling, then bisection."""
    if peak(1) > target:
        return 0
    lo, hi = 1, 2
    while hi <= min(upper, SEARCH_LIMIT) and peak(hi) <= target:
        lo, hi = hi, hi * 2
    hi = min(hi, min(upper, SEARCH_LIMIT) + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if peak(mid) <= target else (lo, mid)
    return lo


def _split(most: int, per_rank: int, asked_effective: int | None, world: int) -> tuple[int, int, str]:
    """(micro-batch <= most, accumulation, a note): the effective batch per_rank x world kept exactly
    where EFFECTIVE_BATCH asks it (a divisor), else as close as whole numbers allow, the difference said."""
    if asked_effective is not None:
        batch = max(b for b in range(1, most + 1) if per_rank % b == 0)
        return batch, per_rank // batch, (f"kept exactly (EFFECTIVE_BATCH={asked_effective}, a multiple of "
                                          f"{batch})")
    accum = math.ceil(per_rank / most)
    candidates = {max(1, per_rank // accum), min(most, math.ceil(per_rank / accum))}
    batch = min(candidates, key=lambda b: (abs(b * accum - per_rank), -b))
    got, processes = batch * accum * world, f" x {world} processes" if world > 1 else ""
    diff = got - per_rank * world
    if diff == 0:
        return batch, accum, f"kept, {batch} x {accum}{processes}"
    return batch, accum, f"{batch} x {accum}{processes} = {got} ({diff:+d}), as close as whole numbers allow"
