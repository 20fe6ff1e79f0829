"""Memory-adaptive settings at start, the memory meter find-batch / doctor / autotune share, the rows
the memory estimate is asked at (row_shape: what the data gives), and the learning-rate rule for a
changed effective batch.

The guides' low-memory trainer, done openly: every setting chosen here is logged through
build's decide() with the numbers behind it, and the effective batch never changes silently.
"MB" is MiB (2**20 bytes), train/core/units.py.
"""

from __future__ import annotations

import ctypes
import gc
import math
import re

import numpy as np
import torch

from train.core.errors import UsageError
from train.core.objective import mode_of
from train.core.units import MIB
from train.models.estimate_terms import packed_grid_of
from train.observe import monitor

# A DataLoader worker is a forked copy of the process; the token memmap is shared pages, but
# Python touches its own objects (reference counts), so each worker soon owns a few hundred MB.
WORKER_MB = 400
RAM_RESERVE_MB = 1024  # left free for the OS and the training process's own growth
LOW_RAM_MB = 2048  # below this, page-locked (pinned) buffers that can never be swapped out are a risk
TOKENS_IN_RAM_SHARE = 0.10  # a token cache under this share of available RAM is read into RAM
PREFETCH_RAM_SHARE = 0.05  # batches in flight (workers x prefetch) may take at most this share


# ---- measuring memory ----


def _status_mb(key: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            found = re.search(rf"^{key}:\s+(\d+)\s+kB", f.read(), re.MULTILINE)
    except OSError:
        return None
    return int(found.group(1)) / 1024 if found else None


def _malloc_trim() -> None:
    # glibc keeps freed heap pages; giving them back makes the next size's peak its own.
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakMeter:
    """Peak memory of a stretch of work, in MB.

    CUDA: torch's peak *reserved* memory (what the caching allocator took from the card, the
    number that runs out), reset with reset_peak_memory_stats after emptying the cache.
    CPU: the process's peak resident set (VmHWM), which the kernel resets when "5" is written to
    /proc/self/clear_refs (Linux 4.0+). RSS is what the OOM killer and a RAM budget count, and it
    tracks a training step closely: on the tiny test model it grows ~2.2 MB per sequence of 64
    tokens, linear from 1 to 128. Freed heap is handed back (malloc_trim) before each reset, so
    a smaller size after a larger one is not charged for the larger one's pages. Without
    clear_refs (not Linux) the CPU peak is the lifetime peak: an overestimate, never an under-.
    """

    def __init__(self, device: torch.device):
        self.device = device

    def reset(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        _malloc_trim()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass

    def peak_mb(self) -> float | None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_reserved(self.device) / MIB
        return _status_mb("VmHWM")


def capacity_mb(device: torch.device, max_memory_mb: int | None) -> tuple[float | None, str]:
    """Memory this process can use, and where the number comes from."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        mine = torch.cuda.memory_reserved(device)
        # free + what we already hold: other processes' memory and the CUDA context are excluded
        cap, why = (free + mine) / MIB, f"free VRAM at start of {total / MIB:.0f} MB"
    else:
        host = monitor.host_memory()
        avail, rss = host.get("ram_available_mb"), host.get("rss_mb") or 0.0
        cap = None if avail is None else avail + rss
        why = "host RAM unknown" if avail is None else (f"host RAM: {avail:.0f} MB available + {rss:.0f} MB "
                                                        f"this process holds")
    if max_memory_mb is not None and (cap is None or max_memory_mb < cap):
        return float(max_memory_mb), "MAX_MEMORY_MB"
    return cap, why


def over_memory(plan) -> str | None:
    """A warning line (the run goes on, exit 0) where the peak estimate at the planned micro-batch
    is over what capacity_mb says the run can use; None where it fits or is unknown. Refused
    (exit 2) only where even one sequence cannot fit: train/models/estimate.py refuse_unfit, earlier."""
    from train.core.model import count_params
    from train.models.estimate import estimate_for_run
    from train.models.freeze import trainable_of
    cfg = plan.cfg
    if cfg.system.offload_optimizer:  # the state lives in host memory; the estimate is of the device
        return None
    # at the rows the data gives, as the fill sized them (a MAX_LENGTH bound would warn of rows that never
    # come)
    shape = row_shape(plan.dataset, plan.collate, plan.max_length, cfg.run.mode, plan.family.layout)
    est = estimate_for_run(
        plan.model.config,
        count_params(plan.model),
        cfg,
        shape["max_length"],
        plan.precision,
        plan.device.type,
        plan.world.world_size,
        trainable_of(plan.model),
        target_length=shape.get("target_length"),
        packed=shape.get("packed"),
    )
    # mem_get_info would make a CUDA context: properties only
    if cfg.run.dry_run and plan.device.type == "cuda":
        from train.core.device import memory_capacity

        cap_bytes, what = memory_capacity(plan.device, cfg.system.max_memory_mb)
        cap = None if cap_bytes is None else cap_bytes / MIB
    else:
        cap, what = capacity_mb(plan.device, cfg.system.max_memory_mb)
    peak = est["peak"] / MIB
    if cap is None or peak <= cap:
        return None
    then = ("out-of-memory retries at a smaller micro-batch" if plan.device.type == "cuda"
            else "swapping or the system killing the run")
    return (
        f"warning: the memory estimate is {peak:,.0f} MB, over the {cap:,.0f} MB this run can use ({what}); "
        f"warned, not refused (the fit check refuses only where one sequence of {plan.max_length} tokens "
        f"cannot fit): "
        f"expect {then}; lower BATCH_SIZE and raise GRADIENT_ACCUM (same effective batch), or set "
        f"ENABLE_GRAD_CKPT=1"
    )


def row_shape(dataset, collate, max_length: int, mode: str, layout) -> dict:
    """The longest rows a micro-batch of this data can hold, as estimate_for_run takes them:
    max_length (and target_length), and packed rows' grid. Pretraining's windows and preference pairs:
    the mode's bound. A sampled mode's (GRPO's): the longest prompt + its completion_length, both said."""
    dataset = getattr(dataset, "dataset", dataset)
    grid = packed_grid_of(dataset)
    if grid is not None:
        return {"max_length": max_length, "packed": grid}
    lengths = getattr(dataset, "lengths", None)
    if mode_of(mode).sampled and lengths is not None and len(lengths):
        # GRPO: a prompt (left-padded to its batch's longest) and the completion sampled after it; COMPILE's
        # widest length bucket is this width (length_buckets' largest is the width it is made from)
        longest, room = int(lengths.max()), dataset.completion_length
        return {"max_length": longest + room, "prompt_length": longest, "completion_length": room}
    if not mode_of(mode).row_lengths or lengths is None or not len(lengths):
        return layout.bound_shape(mode, max_length)  # T5 pretraining: span corruption's target

    def padded(n: int) -> int:
        from train.data.chat.batching import padded_width

        width = padded_width(
            int(n), getattr(collate, "pad_to_multiple_of", 1) or 1, getattr(collate, "widths", None)
        )
        return min(max_length, width)

    return layout.data_shape(lengths, getattr(dataset, "source_lengths", None), padded)


# ---- the learning-rate rule ----


def scaled_lr(lr: float, effective: int, reference: int, rule: str) -> tuple[float, str]:
    """LR_SCALING: linear (Goyal et al.: LR proportional to batch) or sqrt (Adam-style, Krizhevsky's
    'one weird trick'); none keeps LEARNING_RATE as given."""
    ratio = effective / reference
    if rule == "none" or ratio == 1:
        return lr, "kept"
    factor = ratio if rule == "linear" else math.sqrt(ratio)
    why = (f"LR_SCALING={rule}: {lr:g} x {'' if rule == 'linear' else 'sqrt'}({effective}/{reference}) = "
           f"x{factor:.3g}")
    return lr * factor, why


# ---- settings chosen at start ----


def adapt(
    cfg,
    device: torch.device,
    dataset,
    decide,
    world: int = 1,
    host: dict | None = None,
    max_length: int | None = None,
) -> None:
    """Settings chosen from the machine at start, before the loader and the step plan exist, the
    same for every mode. Order matters: the effective batch and LR first (they define the run),
    then memory. max_length: the longest row (default: the packed dataset's window)."""
    dataset = getattr(dataset, "dataset", dataset)  # the packed dataset under a validation Subset
    dataset = getattr(dataset, "windows", dataset)  # T5: span corruption reads the packed windows
    o, d = cfg.optim, cfg.data
    batch_and_lr(o, d.token_budget, decide, world)

    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        decide("vram_free_mb", round(free / MIB), f"of {total / MIB:.0f} MB on "
                                                  f"{torch.cuda.get_device_name(device)}")
        if cfg.system.max_memory_mb is not None:
            share = min(1.0, cfg.system.max_memory_mb * MIB / total)
            torch.cuda.set_per_process_memory_fraction(share, device)
            decide("vram_cap_mb", cfg.system.max_memory_mb, f"MAX_MEMORY_MB: {share:.0%} of the card; beyond "
                                                            f"it a step runs out of memory")
    host = monitor.host_memory() if host is None else host
    avail = host.get("ram_available_mb")
    swap = host.get("swap_used_pct") or 0.0
    if avail is None:
        decide("host_memory", "unknown", "no /proc/meminfo: DataLoader settings kept as given")
        return
    ram = f"{avail:.0f} MB RAM available" + (f", swap {swap:.0f} % used" if swap else "")

    if d.num_workers > 0:
        fits = max(0, int((avail - RAM_RESERVE_MB) // WORKER_MB))
        if fits < d.num_workers:
            decide("num_workers", fits, f"{ram}: {d.num_workers} workers x ~{WORKER_MB} MB + "
                                        f"{RAM_RESERVE_MB} MB reserve would not fit")
            d.num_workers = fits
            if fits == 0:
                d.prefetch_factor, d.persistent_workers = None, False
        else:
            decide("num_workers", d.num_workers, f"kept: {ram} covers {d.num_workers} x ~{WORKER_MB} MB")
    if d.pin_memory:
        if device.type != "cuda":
            decide("pin_memory", False, f"no CUDA device ({device.type}): nothing to pin for")
            d.pin_memory = False
        elif avail < LOW_RAM_MB:
            decide("pin_memory", False, f"{ram}, under {LOW_RAM_MB} MB: pinned pages can't be swapped out")
            d.pin_memory = False
    if d.num_workers > 0:
        rows = max_length if max_length is not None else dataset.max_length
        sequences = mode_of(cfg.run.mode).rows_per_sample  # a pair is two rows (chosen, rejected)
        batch_mb = o.batch_size * sequences * rows * 8 / MIB  # int64 token ids
        prefetch = d.prefetch_factor or 2
        while prefetch > 1 and d.num_workers * prefetch * batch_mb > PREFETCH_RAM_SHARE * avail:
            prefetch //= 2
        in_flight = d.num_workers * prefetch * batch_mb
        if prefetch != (d.prefetch_factor or 2):
            d.prefetch_factor = prefetch
            decide("prefetch_factor", prefetch, f"{d.num_workers} workers x {prefetch} batches = "
                                                f"{in_flight:.0f} MB in flight, "
                   f"under {PREFETCH_RAM_SHARE:.0%} of {ram}")
        else:
            decide("prefetch_factor", prefetch, f"kept: {d.num_workers} workers x {prefetch} batches = "
                                                f"{in_flight:.1f} MB in flight")

    tokens = getattr(dataset, "tokens", None)
    if tokens is None:  # SFT: encoded conversations in memory, no token cache to place
        return
    size_mb = tokens.nbytes / MIB
    if isinstance(tokens, np.memmap) and size_mb <= TOKENS_IN_RAM_SHARE * avail:
        # Forked workers share the copy; spawned ones reopen the memmap (PackedDataset.__getstate__).
        dataset.tokens = np.array(tokens)
        decide("token_cache", "ram", f"{size_mb:.0f} MB, under {TOKENS_IN_RAM_SHARE:.0%} of {ram}: read "
                                     f"once, no page faults")
    else:
        decide("token_cache", "memmap", f"{size_mb:.0f} MB against {ram}: pages read on demand and shared by "
                                        f"workers")


def batch_and_lr(o, token_budget: int | None, decide, world: int) -> None:
    """EFFECTIVE_BATCH -> GRADIENT_ACCUM, then LR_SCALING for the effective batch that results."""
    if o.effective_batch is not None and token_budget is not None:
        raise UsageError(
            f"EFFECTIVE_BATCH={o.effective_batch} counts rows of BATCH_SIZE, which TOKEN_BUDGET replaces; "
            "set GRADIENT_ACCUM instead"
        )
    if (
        o.effective_batch is not None
        and o.effective_batch != o.batch_size * o.gradient_accumulation_steps * world
    ):
        per = o.batch_size * world
        if o.effective_batch % per:
            raise UsageError(
                f"EFFECTIVE_BATCH={o.effective_batch} is not a multiple of BATCH_SIZE={o.batch_size} x "
                f"{world} process(es)"
            )
        o.gradient_accumulation_steps = o.effective_batch // per
        decide("gradient_accumulation_steps", o.gradient_accumulation_steps,
               f"EFFECTIVE_BATCH={o.effective_batch} / (BATCH_SIZE={o.batch_size} x {world} process(es))")
    effective = o.batch_size * o.gradient_accumulation_steps * world
    reference = o.lr_reference_batch or _default_reference()
    if o.lr_scaling != "none":
        lr, why = scaled_lr(o.learning_rate, effective, reference, o.lr_scaling)
        if why != "kept":
            o.learning_rate = lr
        else:
            why = f"LR_SCALING={o.lr_scaling}: effective batch {effective} is the reference"
        decide("learning_rate", o.learning_rate, why)


def _default_reference() -> int:
    """The dataclass defaults' effective batch (config.resolve fills in the preset's instead)."""
    from config import OptimConfig

    return OptimConfig.batch_size * OptimConfig.gradient_accumulation_steps
