"""The peak of allocated bytes over a stretch of real work, counted without a GPU: what
torch.cuda.max_memory_allocated reports on one, for checking the memory estimate
(train/models/estimate.py) against a real CPU step.

`allocated_peak` reads the allocator itself (torch.profiler's memory events: every allocation and free
of the CPU allocator in time order, temporaries inside a kernel included, as logsumexp's (c, V) buffers
in the chunked loss): the figure the estimate is held to.

`LiveBytes` is a TorchDispatchMode: every aten op's outputs (forward, backward and the
optimizer's) add their storages' bytes once, and each storage's bytes come off when it is
freed (a weakref finalizer on the storage). The tensors alive when it starts (parameters,
gradients, optimizer state, given as `held`) are its baseline. Unlike torch's MemTracker it
follows gradient accumulation (several forwards of one module in one step) and names the ops
that hold the most bytes at the peak (`at_peak`), which is how an estimate's missing term is
found. What it cannot see: the temporaries an op makes inside its own kernel (allocated_peak
sees those), and on a GPU a library's scratch (cuBLAS workspaces) and the caching allocator's
rounding (the estimate models the workspaces apart, train/models/estimate_terms.py).
"""

from __future__ import annotations

import weakref
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def storages(tensors) -> dict[int, int]:
    """Storage pointer -> bytes of the distinct storages under `tensors` (views and tied weights once)."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors
            if isinstance(t, torch.Tensor) and t.device.type != "meta"}


def held_by(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> list[torch.Tensor]:
    """What a training step finds allocated: the model's parameters, buffers and gradients, and the
    optimizer's state."""
    tensors = [*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters() if p.grad is not None)]
    if optimizer is not None:
        tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
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


class LiveBytes(TorchDispatchMode):
    """with LiveBytes(held) as live: ... -> live.peak (bytes), live.at_peak (op -> bytes alive at the
    peak that op made). `held`: the tensors alive at the start (held_by), counted once, their views
    not again."""

    def __init__(self, held=()):
        super().__init__()
        self._held = storages(held)
        self.held = self.now = self.peak = sum(self._held.values())
        self._alive: dict[int, tuple[str, int]] = {}  # storage pointer -> (the op that made it, bytes)
        self.at_peak: Counter = Counter()

    def _freed(self, ptr: int) -> None:
        op, nbytes = self._alive.pop(ptr, (None, 0))
        self.now -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if ptr in self._alive or ptr in self._held or st.nbytes() == 0:
                continue
            self._alive[ptr] = (func.__name__, st.nbytes())
            self.now += st.nbytes()
            weakref.finalize(st, self._freed, ptr)
        if self.now > self.peak:
            self.peak = self.now
            self.at_peak = Counter()
            for op, nbytes in self._alive.values():
                self.at_peak[op] += nbytes
        return out
