"""The step-time split: time waiting for the next batch vs time in compute.

The wait is host time blocked in the loader's next() (host clock on every device). Compute is
the time between a batch's arrival and the next fetch (or the end of the optimizer step): on
CUDA it is measured on the device with torch.cuda.Event pairs, read only when a log line is
due, so timing adds no host-device sync per step; on CPU and mps the host clock measures it,
because there the host is the device (CPU) or events are not offered (mps).

data_wait_frac is the share of wall time lost to waiting that compute did not hide:
min(wait, wall - compute) / wall. On CPU compute and wait never overlap, so this is simply
wait / wall. On a GPU the host queues work ahead, and a wait while the GPU is still busy with
queued kernels costs nothing; only the part of the wait the GPU spent idle counts.
"""

from __future__ import annotations

import time

import torch

INPUT_BOUND_FRAC = 0.2
"""Waiting on data above this share of step time: the run (or log interval) is input-bound."""


def exposed_wait_frac(wait_s: float, compute_s: float, wall_s: float) -> float | None:
    """The share of wall_s spent waiting for data that compute did not hide (0-1), or None."""
    if wall_s <= 0:
        return None
    idle = max(0.0, wall_s - compute_s)
    return min(1.0, min(wait_s, idle) / wall_s)


class StepTimer:
    """Splits step time into data wait and compute; totals per log interval and since the
    steady state began (warm-up steps excluded, like samples/s).

    Use: batches = timer.wrap(stream); after each optimizer step timer.step_end(); at a log
    point timer.take_interval(); when warm-up ends timer.start_steady(); at the end
    timer.steady_totals(). The last three wait for the device on CUDA: call them only where the
    loop syncs anyway.
    """

    def __init__(self, device: torch.device):
        self.events = device.type == "cuda"
        self._wait = 0.0  # since the last checkpoint
        self._compute = 0.0
        self._interval = [0.0, 0.0]  # wait, compute since the last take_interval()
        self._steady: list[float] | None = None  # wait, compute since start_steady()
        self._open_start = None  # start mark of the compute segment in progress
        self._pending: list[tuple] = []  # CUDA (start, end) event pairs not yet folded in

    def wrap(self, batches):
        """An iterator over batches that closes the compute segment before each fetch, times
        the fetch, and opens a new segment when the batch is in hand."""
        while True:
            self._close()
            start = time.perf_counter()
            batch = next(batches)
            self._wait += time.perf_counter() - start
            self._open()
            yield batch

    def step_end(self) -> None:
        """Close the segment at the end of an optimizer step (after optimizer.step)."""
        self._close()
        if self.events:
            self._fold(block=False)  # completed pairs only: query() never waits

    def start_steady(self) -> None:
        self._checkpoint()
        self._steady = [0.0, 0.0]

    def take_interval(self) -> tuple[float, float]:
        """(wait_s, compute_s) since the previous call."""
        self._checkpoint()
        wait, compute = self._interval
        self._interval = [0.0, 0.0]
        return wait, compute

    def steady_totals(self) -> tuple[float, float] | None:
        """(wait_s, compute_s) since start_steady(), or None when it was never called."""
        self._checkpoint()
        return None if self._steady is None else (self._steady[0], self._steady[1])

    def _checkpoint(self) -> None:
        self._close()
        if self.events:
            self._fold(block=True)
        for totals in (self._interval, self._steady):
            if totals is not None:
                totals[0] += self._wait
                totals[1] += self._compute
        self._wait = self._compute = 0.0

    def _open(self) -> None:
        if self.events:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._open_start = start
        else:
            self._open_start = time.perf_counter()

    def _close(self) -> None:
        if self._open_start is None:
            return
        if self.events:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((self._open_start, end))
        else:
            self._compute += time.perf_counter() - self._open_start
        self._open_start = None

    def _fold(self, block: bool) -> None:
        # Pairs complete in order on one stream; fold finished ones so the list stays short
        # even with a large LOG_EVERY.
        while self._pending:
            start, end = self._pending[0]
            if block:
                end.synchronize()
            elif not end.query():
                break
            self._compute += start.elapsed_time(end) / 1000  # ms -> s
            self._pending.pop(0)
