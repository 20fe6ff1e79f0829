"""The peak of allocated bytes over a stretch of real work, counted without a GPU: what
torch.cuda.max_memory_allocated reports on one, for checking the memory estimate
(train/models/estimate.py) against a real CPU step.

`allocated_peak` reads the allocator itself (torch.profiler's memory events: every allocation and free
of the CPU allocator in time order, temporaries inside a kernel included, as logsumexp's (c, V) buffers
in the chunked loss): the figure the estimate is held to.

On a GPU it misses a library's scratch (cuBLAS workspaces) and the caching allocator's rounding
(the estimate models the workspaces apart, train/models/estimate_terms.py).
"""

from __future__ import annotations

import torch


def storages(tensors) -> dict[int, int]:
    """Storage pointer -> bytes of the distinct storages under `tensors` (views and tied weights once)."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors
            if isinstance(t, torch.Tensor) and t.device.type != "meta"}


def held_by(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> list[torch.Tensor]:
    """What a training step finds allocated: the model's parameters, buffers and gradients, and the
    optimizer's state."""
    tensors = [
        *model.parameters(),
        *model.buffers(),
        *(p.grad for p in model.parameters() if p.grad is not None),
    ]
    if optimizer is not None:
        tensors += [
            v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)
        ]
    return tensors


def allocated_peak(work, held=()) -> int:
    """Peak bytes allocated while work() runs, from the allocator's own events (torch.profiler with
    profile_memory), above the storages of `held` (held_by: alive before it starts)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        work()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    now = peak = 0
    for event in events:
        now += event.nbytes()
        peak = max(peak, now)
    return sum(storages(held).values()) + peak

