"""The one batch stream every run and tool reads: micro-batches forever, epoch after epoch, with
the position (epoch, samples consumed) a checkpoint stores and a resume restores."""

from __future__ import annotations


class BatchStream:
    """Micro-batches forever, epoch after epoch, knowing where it is: `epoch` and `consumed`
    (samples of that epoch's seeded order handed out so far, by all ranks together: each rank
    takes one micro-batch per micro-step, so a micro-step moves the position by batch_size x
    world_size, or by a round's rows where batches vary in size, sampler.round_rows). Opening
    the first epoch here, before the RNG states are restored, matters: a DataLoader draws a seed
    from torch's generator each time it starts an epoch."""

    def __init__(self, loader, sampler, batch_size: int, epoch: int = 0, consumed: int = 0):
        self.loader, self.sampler, self.batch_size = loader, sampler, batch_size
        self.world_size = getattr(sampler, "world_size", 1)
        self.epoch, self.consumed = epoch, consumed
        self._it = self._open()

    def _open(self):
        self.sampler.set_position(self.epoch, self.consumed)
        return iter(self.loader)

    def __iter__(self):
        return self

    def __next__(self):
        for _ in range(3):  # a resumed position at an epoch's very end yields nothing: next epoch
            try:
                batch = next(self._it)
            except StopIteration:
                self.epoch, self.consumed = self.epoch + 1, 0
                self._it = self._open()
                continue
            round_rows = getattr(self.sampler, "round_rows", None)
            self.consumed += round_rows(self.consumed) if round_rows else self.batch_size * self.world_size
            return batch
        raise RuntimeError("the data yields no batch in a whole epoch")

    def close(self) -> None:
        """Stop the loader's workers now. Left to garbage collection, a loader still referenced
        at exit (a traceback's frames hold it) is stopped by multiprocessing's exit handler
        with SIGTERM, which the workers ignore (train/run/guard/signals.py): the process would hang."""
        shutdown = getattr(self._it, "_shutdown_workers", None)  # what the iterator's __del__ calls
        if shutdown is not None:
            shutdown()

    def remaining(self, position: int) -> int:
        """Samples left of this rank's share of the epoch after global `position`."""
        s = self.sampler
        return len(s) + s.start // self.world_size - position // self.world_size
