"""The objects the checkpoint manager saves and restores own their state: what state_dict()
returns, load_state_dict() puts back (the schedule, the RNG states, the oom_guard's data position, GRPO's
objective mid-generation)."""

from __future__ import annotations

import io
import random
import types

import numpy as np
import pytest
import torch

from config import OptimConfig
from train.core.optim.registry import build_schedule
from train.core.optim.schedules import lr_at
from train.core.reward.guard import RewardSet
from train.core.reward.knobs import GrpoKnobs
from train.core.reward.objective import GRPOObjective
from train.core.reward.sampling import Sampler, SamplingSettings
from train.distributed.world import SINGLE, Dist
from train.run.checkpoint.manager import ObjectiveState
from train.run.checkpoint.rng import RngStates
from train.run.checkpoint.verify import BadCheckpoint, check_objective
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


def grpo(**knobs) -> GRPOObjective:
    sampler = Sampler(SamplingSettings(), eos_ids=[0], pad_id=0, device="cpu")
    return GRPOObjective(False, GrpoKnobs(**knobs), sampler, RewardSet(()), [[1]], lambda i, repeat: ([], {}))


def scored(rows: int = 4) -> dict:
    g = torch.Generator().manual_seed(rows)
    return {"prompt_ids": torch.randint(2, 9, (rows, 3), generator=g), "prompt_mask": torch.ones(rows, 3),
            "completion_ids": torch.randint(2, 9, (rows, 5), generator=g),
            "completion_mask": torch.ones(rows, 5), "advantages": torch.randn(rows, generator=g),
            "old_per_token_logps": torch.randn(rows, 5, generator=g)}


def test_grpo_keeps_a_generations_scored_micro_batches_through_a_checkpoint():
    """NUM_ITERATIONS=2, saved after a generation's first step: the resumed objective trains its second step
    on the same micro-batches (no sampling: the model is never asked), then samples anew."""
    saving = grpo(num_iterations=2, num_generations=2)
    saving._cached, saving._uses, saving._steps = [scored(), scored(6)], 1, 3
    saving._metrics = {"reward": 0.5}
    handle = io.BytesIO()
    torch.save(ObjectiveState(SINGLE, saving, print).state_dict(), handle)  # state.pt's entries
    handle.seek(0)
    entries = torch.load(handle, weights_only=True)
    resumed = grpo(num_iterations=2, num_generations=2)
    check_objective(entries, resumed)  # the load's check leaves the objective as it was
    assert resumed._cached is None and resumed._steps == 0
    ObjectiveState(SINGLE, resumed, print).load_state_dict(entries)
    prompts = [{"index": torch.zeros(2)}, {"index": torch.zeros(3)}]  # 2 x 2 and 3 x 2 rows, as saved
    batches = resumed.rollout(None, prompts)
    pairs = zip(batches, saving._cached, strict=True)
    assert len(batches) == 2 and all(torch.equal(a[k], b[k]) for a, b in pairs for k in a)
    assert (resumed._uses, resumed._steps, resumed._metrics) == (2, 4, {"reward": 0.5})
    # the generation is used up: a checkpoint now keeps no micro-batches, the next step samples
    assert resumed.state_dict() == {"steps": 4, "metrics": {"reward": 0.5}, "uses": 0, "cached": [],
                                    "logged": {}}
    # saved by two processes, resumed by one: another split of the prompts, so nothing is taken
    said = []
    ObjectiveState(SINGLE, (fresh := grpo(num_iterations=2)), said.append).load_state_dict(
        {"objective": entries["objective"], "objective_ranks": [entries["objective"]] * 2})
    assert fresh._cached is None and "saved by 2 process(es), this run has 1" in said[0]
    assert fresh._steps == 3 and fresh._metrics == {"reward": 0.5}  # the rewards' global_step goes on
    ObjectiveState(Dist(rank=1, world_size=2), fresh, said.append).load_state_dict(
        {"objective": {}, "objective_ranks": [{}, entries["objective"]]})  # each rank its own
    assert fresh._uses == 1 and len(said) == 1


def test_a_generation_serves_a_step_cut_otherwise_and_not_a_step_of_another_size():
    """A resumed (or OOM-redone) step whose micro-batches hold the generation's rows cut otherwise trains on
    them regrouped; one that holds another number of rows (BATCH_SIZE or accumulation changed on a resume)
    samples a new generation instead of training on the wrong rows."""
    one = grpo(num_iterations=2, num_generations=2)
    one._cached, one._uses = [scored(), scored()], 1
    (whole,) = one.rollout(None, [{"index": torch.zeros(4)}])  # 8 rows in one micro-batch
    for key, value in whole.items():
        assert torch.equal(value, torch.cat([scored()[key]] * 2)), key
    assert one._uses == 2
    other = grpo(num_iterations=2, num_generations=2)
    other._cached, other._uses, sampled = [scored(), scored()], 1, scored(12)
    other._score = lambda model, micro_batches: [sampled]  # the sampler's part: no model here
    assert other.rollout(None, [{"index": torch.zeros(6)}]) == [sampled] and other._uses == 1


def test_what_the_rewards_log_goes_through_a_checkpoint_and_keeps_apart_from_the_kits_names():
    own = grpo()
    own._metrics = {"reward": 0.5}
    own.rewards.logged.log_metric("reward", 2.0)  # a reward's own figure named like the kit's
    own.rewards.logged.log_metric("mine", 1.0)
    state = own.state_dict()
    assert state["logged"] == {"reward": [2.0], "mine": [1.0]}
    back = grpo()
    back.load_state_dict(state)
    figures = {k: float(v) for k, v in back.returned({"kl": torch.tensor(0.25)}).items()}
    assert figures == {"reward": 0.5, "log_metric/reward": 2.0, "mine": 1.0, "kl": 0.25}
    assert back.state_dict()["logged"] == {}  # reported: taken


@pytest.mark.parametrize("broken, why", [
    ({"steps": -1}, "not counts"),
    ({"metrics": {"reward": "high"}}, "not numbers by name"),
    ({"cached": [{"advantages": [1.0]}]}, "not tensors by name"),
    ({"cached": [{"advantages": torch.zeros(2)}]}, "lack their completions"),
    ({"uses": 0}, "used by 0 steps"),  # micro-batches no step made
])  # fmt: skip
def test_a_malformed_objective_state_is_a_bad_checkpoint_and_changes_nothing(broken, why):
    own = grpo(num_iterations=2)
    own._cached, own._uses, own._steps = [scored()], 1, 7
    state = {**own.state_dict(), "steps": 5, **broken}
    with pytest.raises(BadCheckpoint, match=why):
        check_objective({"objective": state}, own)
    assert own._steps == 7 and own._uses == 1 and own._cached is not None
    with pytest.raises(BadCheckpoint, match="not one state per rank"):
        check_objective({"objective": [state]}, own)


def test_micro_batches_the_knobs_no_longer_fit_are_dropped_not_refused():
    """BETA set since the checkpoint: its micro-batches hold no reference log-probs, so the next step
    samples a new generation (a knob change is no broken checkpoint)."""
    saving = grpo(num_iterations=2)
    saving._cached, saving._uses, saving._steps = [scored()], 1, 3
    now = grpo(num_iterations=2, beta=0.1)
    check_objective({"objective": saving.state_dict()}, now)
    now.load_state_dict(saving.state_dict())
    assert now._cached is None and now._uses == 0 and now._steps == 3
