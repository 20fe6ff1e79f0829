"""Helpers for the find-batch / OOM / doctor / autotune tests: one thread, a fake OOM.

The fake is the one thing this machine lacks: a device that runs out of memory. It is a forward
pre-hook on a tiny real model that raises torch.OutOfMemoryError (the class CUDA and HIP raise)
when a micro-batch is larger than a limit; everything else is the real step.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def one_thread():
    """On a loaded 2-core machine two OpenMP threads spin against each other (tens of times
    slower); one thread is fast and steady (bench/RESULTS.md: about ±1.5 %)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def add_fake_oom(model, limit: int, from_call: int = 1, calls: list | None = None):
    """Raise torch.OutOfMemoryError in forward when the batch is larger than `limit`, from the
    `from_call`-th forward on (so a step can fail half-way through its micro-steps)."""
    calls = [] if calls is None else calls

    def hook(module, args, kwargs):
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        calls.append(ids.shape[0])
        if ids.shape[0] > limit and len(calls) >= from_call:
            raise torch.OutOfMemoryError(f"CUDA out of memory. (fake: micro-batch {ids.shape[0]} > {limit})")

    # on the base model: the kit's chunked loss calls it directly, transformers' loss through the LM
    getattr(model, "base_model", model).register_forward_pre_hook(hook, with_kwargs=True)
    return calls


def patch_fake_oom(monkeypatch, limit: int, from_call: int = 1) -> list:
    """Every model build() makes gets the fake OOM; returns the list of forward batch sizes."""
    import train.models.build

    real = train.models.build.build_model
    calls: list = []

    def build_model(*args, **kwargs):
        model = real(*args, **kwargs)
        add_fake_oom(model, limit, from_call, calls)
        return model

    monkeypatch.setattr(train.models.build, "build_model", build_model)
    return calls


def summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def plan_on_a_fake_gpu(monkeypatch, gb: float) -> None:
    """The plan's micro-batch decision (train/run/plan/make.py micro_batch, where the fill runs) sees a
    CUDA device of `gb` GB, by free memory and by its properties alike (what this machine lacks); the
    model, data and everything else stay on this machine's CPU."""
    import inspect

    from train.core import device as device_lib
    from train.core.units import MIB
    from train.run.plan import adapt, make

    real_micro, real_free, real_whole = make.micro_batch, adapt.capacity_mb, device_lib.memory_capacity
    what = f"a fake {gb:g} GB GPU"

    def micro_batch(*args, **kwargs):
        bound = inspect.signature(real_micro).bind(*args, **kwargs)
        bound.arguments["device"] = torch.device("cuda")  # a device object only: nothing touches a GPU
        return real_micro(*bound.args, **bound.kwargs)

    def capacity_mb(device, cap):
        return (gb * 1000**3 / MIB, what) if device.type == "cuda" else real_free(device, cap)

    def memory_capacity(device, cap=None):
        return (int(gb * 1000**3), what) if device.type == "cuda" else real_whole(device, cap)

    monkeypatch.setattr(make, "micro_batch", micro_batch)
    monkeypatch.setattr(adapt, "capacity_mb", capacity_mb)
    monkeypatch.setattr(device_lib, "memory_capacity", memory_capacity)
