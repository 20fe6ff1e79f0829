"""Reward training past one process: GRPO through the launcher on two processes (torchrun, gloo, DDP on
CPU), the built-in task, a tiny GPT-2 made by the tests, short completions. One run of 4 steps, and one
stopped at its step-2 checkpoint then resumed to 4 (RESUME=1, again two processes).

What each check stands for:
- rank 0 alone writes: one metrics.jsonl, one "done:" line, summary.json's world_size 2;
- each rank draws its own completions: state.pt keeps every rank's sampler generator (rng_ranks), and
  the two differ, each moved on from the seed (SEED + rank) it started from;
- the ranks hold the same weights: the resumed run's two ranks both load rank 0's checkpoint, and its
  steps 3 and 4 (losses and rollout figures averaged over both ranks, each rank sampling with its own
  weights) and its final/ repeat the uninterrupted run's. Had rank 1's weights drifted from rank 0's
  (gradients not all-reduced), the uninterrupted run's rank 1 would have sampled and scored with
  other weights than the resumed one's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import launch, read_jsonl

SEED = 1337
SAME = ("loss", "grad_norm", "reward", "reward_std", "completions/mean_length", "entropy")


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
        "REWARD_FUNCS": "format",
        "REWARD_PATTERN": "e",  # a letter some completions of a barely trained model hold: rewards that vary
        "LEARNING_RATE": "1e-3",
        "LR_SCHEDULE": "constant",
        "WARMUP_STEPS": "1",
        "SAVE_EVERY": "2",
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
    """{"whole", "split", "resumed"}: the completed processes (split: stopped after step 2)."""
    root = tmp_path_factory.mktemp("grpo_ranks")
    done = {"whole": launch("train_grpo.sh", env_of(root, base_model, "whole", MAX_STEPS="4"))}
    done["split"] = launch("train_grpo.sh", env_of(root, base_model, "split", MAX_STEPS="2"))
    ok(done["split"])
    # the checkpoint as the stop left it (the resumed run adds a newer one)
    done["state"] = torch.load(
        root / "runs" / "split" / "checkpoints" / "step-00000002" / "state.pt", weights_only=True
    )
    done["resumed"] = launch("train_grpo.sh", env_of(root, base_model, "split", MAX_STEPS="4", RESUME="1"))
    done["root"] = root / "runs"
    return done


def rows(run: Path) -> list[dict]:
    return [r for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]


def test_two_processes_write_one_set_of_outputs(runs):
    ok(runs["whole"])
    run = runs["root"] / "whole"
    assert runs["whole"].stdout.count("done:") == 1  # rank 0 alone prints
    assert sorted(p.name for p in run.rglob("metrics*.jsonl")) == ["metrics.jsonl"]
    assert [r["step"] for r in rows(run)] == [1, 2, 3, 4]
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["mode"], summary["world_size"], summary["samples"]) == ("grpo", 2, 4 * 2 * 2)
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


def test_resume_on_two_processes_repeats_the_uninterrupted_run(runs):
    ok(runs["resumed"])
    whole, split = rows(runs["root"] / "whole"), rows(runs["root"] / "split")
    assert [r["step"] for r in split] == [1, 2, 3, 4]
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
