"""Past one process: torchrun's variables, the process group, rank-0-only outputs, errors every
rank agrees on, and reductions for the log. DDP / FSDP2 wrapping and sharded checkpoints are
in train/distributed/parallel.py.

The kit scales on the engines PyTorch has: DistributedDataParallel, and fully_shard (FSDP2) for
the guides' ZeRO-2 / ZeRO-3. The trainer reads only RANK, LOCAL_RANK and WORLD_SIZE (here, once,
in `from_env`), so torchrun, `accelerate launch` and a cluster scheduler start it the same way;
the loop gets a `Dist` and never reads the environment.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import resource
import sys
from typing import NoReturn

import torch
import torch.distributed as dist

from train.core.errors import UsageError

# (the kit's names)
from train.distributed.world import SINGLE, Dist, from_env, needs_group, quiet_errors  # noqa: F401

# Host-side agreement (stop signals, non-finite streaks) runs on gloo: with NCCL the default
# group's collectives would need a CUDA tensor and a device sync each step.
_host_group = None

# Rank 0 builds the data caches (tokenizer training, tokenizing) while the others wait in a
# barrier: on a large corpus that takes minutes, longer than NCCL's 10-minute default.
GROUP_TIMEOUT = datetime.timedelta(minutes=30)

# Set once this process has started a process group (see exit_process).
_group_used = False


def _backend(device_setting: str) -> str:
    from train.core.device import resolve_device

    device, _ = resolve_device(device_setting)
    if device.type == "mps":
        raise UsageError("NPROC_PER_NODE / SHARDING: Apple mps has no collective backend; set DEVICE=cpu")
    return "nccl" if device.type == "cuda" else "gloo"


def launch(train_fn, cfg, world: Dist) -> int:
    """Run train_fn(cfg, world) inside a process group when one is needed, and take it down after.
    Bad input stops every rank with exit code 2; only rank 0 prints the line."""
    with quiet_errors(world):
        if not needs_group(world, cfg.system.sharding):
            return train_fn(cfg, world)
        backend = _backend(cfg.system.device)
        if backend == "nccl":
            if world.local_rank >= torch.cuda.device_count():
                raise UsageError(
                    f"NPROC_PER_NODE: LOCAL_RANK {world.local_rank} but only {torch.cuda.device_count()} "
                    f"GPU(s) visible"
                )
            torch.cuda.set_device(world.local_rank)
        if world.world_size == 1:
            # SHARDING on one process (offload on one GPU): a group of one, no rendezvous needed.
            dist.init_process_group(
                backend, store=dist.HashStore(), rank=0, world_size=1, timeout=GROUP_TIMEOUT
            )
        else:
            dist.init_process_group(
                backend, rank=world.rank, world_size=world.world_size, timeout=GROUP_TIMEOUT
            )
        global _host_group, _group_used
        _group_used = True
        _host_group = dist.new_group(backend="gloo", timeout=GROUP_TIMEOUT) if backend == "nccl" else None
        try:
            code = train_fn(cfg, world)
            dist.barrier()  # no rank tears the group down while another still talks to it
            return code
        except Exception as err:
            if world.world_size == 1 or not _lost_peer(err):
                raise
            # Another rank died: a traceback per survivor says nothing more than this line.
            if world.is_main:
                print(
                    f"error: lost contact with another process of the run ({type(err).__name__})",
                    file=sys.stderr,
                )
            return 1
        finally:
            _host_group = None
            dist.destroy_process_group()


def exit_process(code: int, group_used: bool | None = None) -> NoReturn:
    """Exit with `code`; after a process group (group_used, or one started by launch) without
    the interpreter's finalization, which can abort the process with SIGABRT ("terminate called
    without an active exception") after everything succeeded: destroy_process_group leaves the
    group's gloo worker threads running (FSDP2's device mesh and DTensor caches still hold the
    group), and one of them may still be dropping the last reference to a collective's tensor
    whose Python object is gone, which takes the GIL. Python 3.11 ends a thread that asks for
    the GIL while it finalizes with pthread_exit, and that unwinding through C++ calls
    std::terminate. The atexit handlers (log files, loader workers) still run first, while
    every thread may take the GIL; then os._exit skips only the teardown."""
    if not (_group_used if group_used is None else group_used):
        sys.exit(code)
    atexit._run_exitfuncs()  # what finalization would run before it starts ending threads
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def _lost_peer(err: Exception) -> bool:
    """A collective failed because another rank is gone (gloo raises RuntimeError, NCCL a
    DistError)."""
    text = str(err)
    return isinstance(err, dist.DistError) or (
        isinstance(err, RuntimeError)
        and any(k in text for k in ("Connection closed by peer", "Connection reset by peer"))
    )


def _active() -> bool:
    return dist.is_available() and dist.is_initialized()


def agree(error: str | None) -> None:
    """Raise the same UsageError on every rank when any rank met one, so none waits forever in
    a collective that a failed rank will never join."""
    if not _active() or dist.get_world_size() == 1:
        if error:
            raise UsageError(error)
        return
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), None)
    if first:
        raise UsageError(first)


def gather(value) -> list:
    """value from every rank, in rank order ([value] with one process)."""
    if not _active() or dist.get_world_size() == 1:
        return [value]
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def gather_rows(rows: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Every rank's rows of a small host tensor (their number may differ by rank) in rank order, and
    where this rank's start; (rows, 0) with one process. Two all-gathers on the host group (GRPO's
    rewards of a generation batch: TRL gathers them to scale over the whole batch)."""
    if not _active() or dist.get_world_size() == 1:
        return rows, 0
    n = dist.get_world_size()
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
    dist.all_gather(counts, torch.tensor([rows.shape[0]], dtype=torch.int64), group=_host_group)
    sizes = [int(c) for c in counts]
    padded = torch.zeros((max(sizes), *rows.shape[1:]), dtype=rows.dtype)
    padded[: rows.shape[0]] = rows
    parts = [torch.empty_like(padded) for _ in range(n)]
    dist.all_gather(parts, padded, group=_host_group)
    every = torch.cat([part[:size] for part, size in zip(parts, sizes, strict=True)])
    return every, sum(sizes[: dist.get_rank()])


def gather_names(names: list[str]) -> list[str]:
    """The sorted union of every rank's names (what GRPO's rewards logged with log_metric: a rank's
    functions may log a name another's did not); the names themselves with one process."""
    if not _active() or dist.get_world_size() == 1:
        return sorted(names)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, sorted(names), group=_host_group)
    return sorted({n for part in every for n in part})


def _on_host(world: Dist, values, op) -> list[int]:
    """One all-reduce of a few integers on the host (no device sync); the numbers themselves
    with one process."""
    if world.world_size == 1 or not _active():
        return list(values)
    box = torch.tensor(list(values), dtype=torch.int64)
    dist.all_reduce(box, op=op, group=_host_group)
    return box.tolist()


def max_across(world: Dist, values: list[int]) -> list[int]:
    """The largest of each number over all ranks (a stop signal, a non-finite streak)."""
    return _on_host(world, values, dist.ReduceOp.MAX)


def sum_across(world: Dist, counts) -> tuple[int, ...]:
    """Whole numbers (rows, tokens) summed over all ranks."""
    return tuple(_on_host(world, counts, dist.ReduceOp.SUM))


def step_total(world: Dist):
    """For train_step: (a step's target tokens over all ranks, ranks), one host all-reduce per
    optimizer step; None with one process (nothing to add up). A tuple of counts (preference
    training's pairs and chosen tokens) is summed item by item in the same all-reduce."""
    if world.world_size == 1:
        return None

    def total(counts):
        many = isinstance(counts, tuple)
        summed = sum_across(world, list(counts) if many else [counts])
        return (tuple(summed) if many else summed[0]), world.world_size

    return total


def _attempt(fn):
    try:
        return fn(), None
    except UsageError as err:
        return None, str(err)


def on_main(world: Dist, fn):
    """fn() on rank 0 only; its result (or its error) reaches every rank."""
    result, error = _attempt(fn) if world.is_main else (None, None)
    agree(error)
    if _active() and dist.get_world_size() > 1:
        box = [result]
        dist.broadcast_object_list(box, src=0)
        result = box[0]
    return result


def main_first(world: Dist, fn):
    """fn() on each machine's local rank 0 first (it fills the tokenizer and token caches), then
    on the other ranks, which find the caches ready instead of racing to write them."""
    result, error = _attempt(fn) if world.local_rank == 0 else (None, None)
    agree(error)
    if world.local_rank != 0:
        result, error = _attempt(fn)
    agree(error)
    return result


def rank_device(device: torch.device, why: str, world: Dist) -> tuple[torch.device, str]:
    """One GPU per process: cuda:LOCAL_RANK."""
    if world.world_size > 1 and device.type == "cuda":
        return torch.device("cuda", world.local_rank), f"one GPU per process: LOCAL_RANK={world.local_rank}"
    return device, why


def mean_across(world: Dist, loss: torch.Tensor, waited: float) -> tuple[torch.Tensor, float]:
    """Loss (a scalar, or a vector of figures) and data-wait averaged over ranks: one all-reduce,
    at log points only (gloo has no AVG, so SUM / world size)."""
    if world.world_size == 1 or not _active():
        return loss, waited
    wait = torch.tensor([waited], device=loss.device, dtype=torch.float32)
    both = torch.cat([loss.detach().float().reshape(-1), wait])
    dist.all_reduce(both)
    both /= world.world_size
    return both[:-1].reshape(loss.shape), both[-1].item()


def _peak_rss_mb() -> float | None:
    try:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    except (OSError, ValueError):
        return None
    return round(peak / 2**20 if sys.platform == "darwin" else peak / 1024, 1)  # bytes on macOS, kB on Linux


def add_rank_figures(summary: dict, world: Dist, device: torch.device) -> dict:
    """Per-rank peak memory (all_gather, once at the end) and per-rank throughput; the totals
    stay global (samples over all ranks), MFU is per GPU."""
    mine = {
        "rank": world.rank,
        "peak_vram_mb": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None,
        "peak_rss_mb": _peak_rss_mb(),
    }
    ranks = [mine]
    if world.world_size > 1 and _active():
        ranks = [None] * world.world_size
        dist.all_gather_object(ranks, mine)
    vram = [r["peak_vram_mb"] for r in ranks if r["peak_vram_mb"] is not None]
    n = world.world_size
    summary["world_size"] = n
    summary["per_rank"] = ranks
    summary["peak_vram_mb"] = max(vram) if vram else summary.get("peak_vram_mb")
    summary["peak_vram_mb_total"] = sum(vram) if vram else None
    for key in ("samples_per_sec", "tokens_per_sec"):
        summary[f"{key}_per_rank"] = summary[key] / n if summary.get(key) is not None else None
    if summary.get("mfu") is not None:
        summary["mfu"] /= n  # achieved FLOPs are over all GPUs, the peak is one GPU's
    return summary

