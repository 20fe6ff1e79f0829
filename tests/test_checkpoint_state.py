"""The objects the checkpoint manager saves and restores own their state: what state_dict()
returns, load_state_dict() puts back (the schedule, the RNG states, the oom_guard's data position)."""

from __future__ import annotations

import random
import types

import numpy as np
import pytest
import torch

from config import OptimConfig
from train.core.optim.registry import build_schedule
from train.core.optim.schedules import lr_at
from train.run.checkpoint.rng import RngStates
from train.run.loop.oom import OomGuard


def test_build_schedule_gives_lr_at_by_samples_and_round_trips_its_curve():
    optim = OptimConfig(learning_rate=1.0, min_lr_ratio=0.1)
    schedule = build_schedule(optim, effective=4, warmup_steps=10, total_steps=100)
    for step in (0, 9, 55, 99):
        assert schedule.lr(step * 4) == pytest.approx(lr_at(step, 1.0, 10, 100, 0.1), rel=1e-12)
    saved = schedule.state_dict()
    assert saved == {"unit_samples": 4, "warmup_samples": 40, "budget_samples": 400}  # meta.json's format
    # a resume with another peak keeps the saved curve and the config's learning rate
    other = build_schedule(OptimConfig(learning_rate=0.5, min_lr_ratio=0.1), 8, 1, 2).load_state_dict(saved)
    assert other.state_dict() == saved and other.lr(200) == pytest.approx(schedule.lr(200) / 2, rel=1e-12)


def test_rng_states_put_back_every_generator():
    rng = RngStates(types.SimpleNamespace(rank=0, world_size=1))
    state = rng.state_dict()
    drawn = (random.random(), np.random.rand(), torch.rand(3))
    rng.load_state_dict(state)
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert drawn[:2] == again[:2] and torch.equal(drawn[2], again[2])


def test_feed_saves_and_reopens_its_data_position():
    class Stream:
        def __init__(self, epoch, consumed):
            self.epoch, self.consumed = epoch, consumed

        def close(self):
            pass

    cfg = types.SimpleNamespace(optim=types.SimpleNamespace(batch_size=4, gradient_accumulation_steps=2))
    plan = types.SimpleNamespace(
        cfg=cfg, device=torch.device("cpu"), world=types.SimpleNamespace(world_size=3)
    )
    opened = []

    def open_stream(batch_size, epoch, start):
        opened.append((batch_size, epoch, start))
        return Stream(epoch, start)

    oom_guard = OomGuard(plan, open_stream, None, None, print)
    oom_guard.load_state_dict({"epoch": 2, "position": 96})
    assert opened == [(4, 2, 96)]
    oom_guard.stream.consumed += 24
    assert oom_guard.state_dict() == {"epoch": 2, "position": 120, "world_size": 3}
