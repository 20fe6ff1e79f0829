"""Stop signals: SIGINT (Ctrl+C) and SIGTERM (a scheduler's preemption) end a run cleanly.

The first signal asks the loop to stop after the optimizer step in progress (it then saves a
checkpoint and summary.json); a second one exits at once. DataLoader workers ignore both, so
the step being finished still gets its batches.
"""

from __future__ import annotations

import os
import signal
import threading


def _ignore_stop_signals(inner, worker_id: int) -> None:
    # DataLoader workers share the terminal's process group: without this, Ctrl+C kills them
    # mid-step and the step the main process is finishing fails.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if inner is not None:
        inner(worker_id)


class QuietWorkers:
    """Picklable worker_init_fn (spawned workers receive it by pickle)."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, worker_id: int) -> None:
        _ignore_stop_signals(self.inner, worker_id)


class StopSignals:
    """SIGINT/SIGTERM: the first asks the loop to stop after the current optimizer step; a
    second exits at once (saves are atomic, so the last checkpoint stays valid)."""

    def __init__(self, announce: bool = True):
        self.received: int | None = None
        self._previous: dict = {}
        self.announce = announce  # under torchrun, rank 0 alone says it

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            if self.announce:
                os.write(2, f"\n{name} again: quitting now; the last checkpoint is intact\n".encode())
            os._exit(128 + signum)
        self.received = signum
        if not self.announce:
            return
        # os.write, not print: a handler may run in the middle of another write to the console.
        os.write(
            2, f"\n{name}: finishing this optimizer step, then saving ({name} again quits at once)\n".encode()
        )

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
