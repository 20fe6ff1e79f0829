"""Every random-number state a run draws from (Python, numpy, torch CPU, CUDA, mps), as plain
tensors and numbers so a checkpoint's state.pt loads with torch.load(weights_only=True)."""

from __future__ import annotations

import random

import numpy as np
import torch

from train.distributed import process_group


def rng_state(generators: dict | None = None) -> dict:
    """Every random-number state the run draws from, as plain tensors and numbers (numpy's
    array becomes a tensor, so weights_only loading accepts it); generators: an objective's own
    torch.Generators by name (GRPO's sampler), kept as "generators"."""
    np_state = np.random.get_state(legacy=False)
    state = {
        "python": random.getstate(),
        "numpy": {
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        state["mps"] = torch.mps.get_rng_state()
    if generators:
        state["generators"] = {name: g.get_state() for name, g in generators.items()}
    return state


def set_rng_state(state: dict, generators: dict | None = None) -> None:
    random.setstate(state["python"])
    np_state = state["numpy"]
    key = np_state["key"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", key, np_state["pos"], np_state["has_gauss"], np_state["gauss"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "mps" in state and getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        torch.mps.set_rng_state(state["mps"])
    for name, g in (generators or {}).items():
        if name in state.get("generators", {}):
            g.set_state(state["generators"][name])


def rng_states(rngs: list | None) -> dict:
    """state.pt's RNG entries: rank 0's (or this process's) states, and with several processes
    every rank's, so each draws its own dropout masks again after a resume (ranks whose batches
    differ in shape, as SFT's do, draw different amounts and drift apart)."""
    if not rngs:
        return {"rng": rng_state()}
    return {"rng": rngs[0], **({"rng_ranks": rngs} if len(rngs) > 1 else {})}


class RngStates:
    """The run's random-number states as one entry of the checkpoint (state.pt's rng, and
    rng_ranks with several processes), owning its state_dict / load_state_dict."""

    def __init__(self, world, generators: dict | None = None):
        """generators: an objective's own torch.Generators by name (Objective.generators())."""
        self.world, self.generators = world, generators

    def state_dict(self) -> dict:
        """Every rank's states (a collective: every rank calls it at the same step)."""
        return rng_states(process_group.gather(rng_state(self.generators)))

    def load_state_dict(self, state: dict) -> None:
        """Each rank its own states; with another number of processes, rank 0's for all."""
        ranks, world = state.get("rng_ranks"), self.world
        own = ranks[world.rank] if ranks and len(ranks) == world.world_size else state["rng"]
        set_rng_state(own, self.generators)
