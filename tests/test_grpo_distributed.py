"""Reward training past one process: GRPO through the launcher on two processes (torchrun, gloo, DDP on
CPU), the built-in task, a tiny GPT-2 made by the tests, short completions, SCALE_REWARDS=batch and a
user's reward file that writes down what each rank scored, NUM_ITERATIONS=2. One run of 5 steps, and one
stopped at its step-3 checkpoint (inside the second generation) then resumed to 5 (RESUME=1, again two
processes).

What each check stands for:
- rank 0 alone writes: one metrics.jsonl, one "done:" line, summary.json's world_size 2;
- each rank draws its own completions: state.pt keeps every rank's sampler generator (rng_ranks), and
  the two differ, each moved on from the seed (SEED + rank) it started from;
- each rank's scored completions of the generation the checkpoint is in are in it (objective_ranks) and
  serve step 4 again (the resumed run samples again at step 5);
- the ranks hold the same weights: the resumed run's two ranks both load rank 0's checkpoint, and its
  steps 4 and 5 (losses and rollout figures averaged over both ranks, each rank scoring and sampling
  with its own weights) and its final/ repeat the uninterrupted run's. Had rank 1's weights drifted
  from rank 0's (gradients not all-reduced), the uninterrupted run's rank 1 would have sampled and
  scored with other weights than the resumed one's;
- SCALE_REWARDS=batch divides by the std of both ranks' rewards (TRL gathers them): each step's loss
  (DAPO on-policy: minus the token-weighted mean advantage over both ranks) is the one a single process
  computes from both ranks' rewards, not the one of each rank's own std; the reward metrics are the
  whole batch's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import launch, read_jsonl
from train.core.reward import GrpoKnobs, group_advantages

SEED = 1337
SAME = ("loss", "grad_norm", "reward", "reward_std", "completions/mean_length", "entropy")


# Rewards that vary (0 to 6 by the completion's ids), each rank's written down with the completion lengths.
REWARD = """import json
import torch.distributed as dist


def scrambled(completion_ids, trainer_state, **kwargs):
    values = [float(sum(ids) % 7) for ids in completion_ids]
    rank = dist.get_rank() if dist.is_initialized() else 0
    with open(f"{dump}-{{rank}}.jsonl", "a") as handle:
        lengths = [len(ids) for ids in completion_ids]
        row = {{"step": trainer_state.global_step, "max_steps": trainer_state.max_steps, "rewards": values,
               "lengths": lengths}}
        handle.write(json.dumps(row) + "\\n")
    kwargs["log_metric"]("seen/rank", float(rank))  # every rank's, averaged: 0.5
    if rank == 1:
        kwargs["log_metric"]("seen/rank_one", 5.0)  # one rank's name: every rank reports it
    return values
"""


def env_of(root: Path, model: Path, name: str, **more: str) -> dict:
    return {
        "MODEL_PATH": str(model),
        "OUTPUT_DIR": str(root / "runs"),
        "CACHE_DIR": str(root / "cache"),
        "RUN_NAME": name,
        "NPROC_PER_NODE": "2",
        "BATCH_SIZE": "2",
        "NUM_GENERATIONS": "4",
        "MAX_COMPLETION_LENGTH": "4",
        "REWARD_FUNCS": f"{root / name}.py:scrambled",
        "SCALE_REWARDS": "batch",
        "LEARNING_RATE": "1e-3",
        "LR_SCHEDULE": "constant",
        "WARMUP_STEPS": "1",
        "SAVE_EVERY": "3",
        "NUM_ITERATIONS": "2",  # steps 1-2 and 3-4 are generations: the split at step 3 is inside one
        "LOG_EVERY": "1",
        "NUM_WORKERS": "0",
        "SEED": str(SEED),
        "TOKENIZE_WORKERS": "1",
        "OMP_NUM_THREADS": "1",
        **more,
    }


def ok(run) -> None:
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]


@pytest.fixture(scope="module")
def runs(base_model, tmp_path_factory) -> dict:
    """{"whole", "split", "resumed"}: the completed processes (split: stopped after step 3)."""
    root = tmp_path_factory.mktemp("grpo_ranks")
    for name in ("whole", "split"):
        (root / f"{name}.py").write_text(REWARD.format(dump=root / name))
    done = {"whole": launch("train_grpo.sh", env_of(root, base_model, "whole", MAX_STEPS="5"))}
    done["split"] = launch("train_grpo.sh", env_of(root, base_model, "split", MAX_STEPS="3"))
    ok(done["split"])
    # the checkpoint as the stop left it (the resumed run adds a newer one)
    done["state"] = torch.load(
        root / "runs" / "split" / "checkpoints" / "step-00000003" / "state.pt", weights_only=True
    )
    done["resumed"] = launch("train_grpo.sh", env_of(root, base_model, "split", MAX_STEPS="5", RESUME="1"))
    done["root"] = root / "runs"
    return done


def rows(run: Path) -> list[dict]:
    return [r for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]


def test_two_processes_write_one_set_of_outputs(runs):
    ok(runs["whole"])
    run = runs["root"] / "whole"
    assert runs["whole"].stdout.count("done:") == 1  # rank 0 alone prints
    assert sorted(p.name for p in run.rglob("metrics*.jsonl")) == ["metrics.jsonl"]
    assert [r["step"] for r in rows(run)] == [1, 2, 3, 4, 5]
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["mode"], summary["world_size"], summary["samples"]) == ("grpo", 2, 5 * 2 * 2)
    assert [r["rank"] for r in summary["per_rank"]] == [0, 1]
    assert (run / "final" / "model.safetensors").is_file()


def test_each_rank_draws_its_own_completions(runs):
    ranks = runs["state"]["rng_ranks"]
    assert len(ranks) == 2
    drawn = [r["generators"]["sampler"] for r in ranks]
    assert not torch.equal(drawn[0], drawn[1])
    for rank, state in enumerate(drawn):
        fresh = torch.Generator().manual_seed(SEED + rank).get_state()
        assert not torch.equal(state, fresh), f"rank {rank}'s sampler drew nothing"
    # step 3 began a generation that step 4 trains on again: each rank's own scored completions are kept
    kept = runs["state"]["objective_ranks"]
    assert [(k["steps"], k["uses"], len(k["cached"])) for k in kept] == [(3, 1, 1)] * 2
    assert not torch.equal(kept[0]["cached"][0]["completion_ids"], kept[1]["cached"][0]["completion_ids"])


def test_resume_on_two_processes_repeats_the_uninterrupted_run(runs):
    ok(runs["resumed"])
    whole, split = rows(runs["root"] / "whole"), rows(runs["root"] / "split")
    assert [r["step"] for r in split] == [1, 2, 3, 4, 5]
    for a, b in zip(whole, split, strict=True):
        for name in SAME:
            assert a[name] == pytest.approx(b[name], rel=1e-5, abs=1e-6), (a["step"], name)
    # steps that train (GRPO's on-policy loss is ~0 by construction; its gradient is not)
    assert all(r["grad_norm"] > 0 and r["reward_std"] > 0 for r in whole)
    assert whole[-1]["entropy"] != whole[0]["entropy"]
    one = load_file(runs["root"] / "whole" / "final" / "model.safetensors")
    two = load_file(runs["root"] / "split" / "final" / "model.safetensors")
    assert one.keys() == two.keys()
    for key in one:
        torch.testing.assert_close(one[key], two[key], rtol=0, atol=1e-6, msg=key)


def test_batch_scaling_and_the_reward_metrics_are_the_whole_batchs(runs):
    ok(runs["whole"])
    ranks = [read_jsonl(runs["root"].parent / f"whole-{rank}.jsonl") for rank in (0, 1)]
    knobs = GrpoKnobs(num_generations=4, scale_rewards="batch")
    apart = []
    sampled = rows(runs["root"] / "whole")[::2]  # a generation's first step: its loss is on-policy
    for row, *mine in zip(sampled, *ranks, strict=True):
        assert [m["step"] for m in mine] == [row["step"] - 1] * 2
        assert [m["max_steps"] for m in mine] == [5] * 2  # the run's optimizer steps, not x world size
        rewards = torch.tensor([m["rewards"] for m in mine]).reshape(-1, 1)  # rank 0's rows, then rank 1's
        lengths = torch.tensor([m["lengths"] for m in mine], dtype=torch.float32).reshape(-1)
        whole, metrics = group_advantages(rewards, ["scrambled"], knobs)
        # on-policy DAPO: every ratio is 1, so the loss is minus the advantages' token-weighted mean
        assert row["loss"] == pytest.approx(-float((whole * lengths).sum() / lengths.sum()), abs=1e-6)
        for name in ("reward", "reward_std", "frac_reward_zero_std"):
            assert row[name] == pytest.approx(metrics[name], abs=1e-6), (row["step"], name)
        assert row["completions/max_length"] == lengths.max()
        each = torch.cat([group_advantages(r, ["scrambled"], knobs)[0] for r in rewards.split(8)])
        apart.append(abs(row["loss"] + float((each * lengths).sum() / lengths.sum())))
    assert max(apart) > 1e-3  # each rank's own std would have given other losses


def test_what_the_rewards_log_is_every_ranks_mean_at_the_steps_they_ran(runs):
    for row in rows(runs["root"] / "whole"):
        generated = row["step"] % 2 == 1  # NUM_ITERATIONS=2: the rewards run on steps 1, 3, 5
        assert row.get("seen/rank") == (0.5 if generated else None), row["step"]
        assert row.get("seen/rank_one") == (5.0 if generated else None), row["step"]
