"""Where this process stands among the processes (torchrun's RANK, LOCAL_RANK, WORLD_SIZE), read
once; imports no torch, so bad flags are answered before torch loads (train/cli.py). The process
group and its collectives are train/distributed/process_group.py's."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from train.core.errors import EXIT_USAGE, UsageError


@dataclass(frozen=True)
class Dist:
    """Where this process stands: its rank among all processes, its GPU index on this machine."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        """Rank 0 alone prints, writes the run folder and saves final/."""
        return self.rank == 0


SINGLE = Dist()


def from_env(environ) -> Dist:
    """The standard launcher variables (torchrun, accelerate launch, a scheduler's torchrun).
    None set: one process."""
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
    if not any(environ.get(name) for name in names):
        return SINGLE
    values = {}
    for name in names:
        text = environ.get(name, "")
        if name == "LOCAL_RANK" and text == "":
            text = environ.get("RANK", "")  # one machine: the local rank is the rank
        if not text.strip().isdigit():
            raise UsageError(f"{name}: expected a whole number >= 0 (set by torchrun), got {text!r}")
        values[name] = int(text)
    world = Dist(rank=values["RANK"], local_rank=values["LOCAL_RANK"], world_size=values["WORLD_SIZE"])
    if world.world_size < 1 or world.rank >= world.world_size:
        raise UsageError(
            f"RANK={world.rank} with WORLD_SIZE={world.world_size}: the rank must be below the world size"
        )
    return world


def needs_group(world: Dist, sharding: str) -> bool:
    """A process group exists with several processes, and for FSDP2 even with one."""
    return world.world_size > 1 or sharding != "none"


@contextlib.contextmanager
def quiet_errors(world: Dist):
    """Every rank meets the same bad input; one error line is enough."""
    try:
        yield
    except UsageError:
        if world.is_main:
            raise
        raise SystemExit(EXIT_USAGE) from None
