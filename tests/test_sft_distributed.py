"""SFT past one process: the length-grouped and token-budget samplers deal each epoch's batches
to the ranks in turn (disjoint, equal counts, the whole trimmed epoch), a global position puts
every rank back exactly where the uninterrupted run was, one process behaves as before, and
a real 2-process SFT run goes through the launcher (torchrun, gloo)."""

from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pytest

from conftest import launch, read_jsonl
from train.data.chat.batching import (
    BudgetSampler,
    GroupedSampler,
    LengthGroupedSampler,
    TokenBudgetBatchSampler,
)
from train.run.checkpoint.on_disk import list_checkpoints

EPOCH = 1  # not 0: the epoch must reach the order


def lengths_of(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice([rng.randint(5, 40), rng.randint(60, 200)]) for _ in range(n)]


def flat(batches) -> list[int]:
    return [i for b in batches for i in b]


def trimmed(batches: list, world_size: int) -> list:
    return batches[: len(batches) - len(batches) % world_size]


def grouped(lengths, bs, rank=0, world_size=1, start=0) -> GroupedSampler:
    sampler = GroupedSampler(lengths, bs, seed=3, rank=rank, world_size=world_size)
    sampler.set_position(EPOCH, start)
    return sampler


def budget(lengths, rank=0, world_size=1, start=0) -> BudgetSampler:
    sampler = BudgetSampler(lengths, 600, seed=5, rank=rank, world_size=world_size)
    sampler.set_position(EPOCH, start)
    return sampler


# ---- LENGTH_GROUPING=1 -------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [2, 3])
def test_grouped_batches_are_dealt_in_turn_disjoint_and_cover_the_epoch(world_size):
    lengths, bs = lengths_of(203), 4  # 50 full batches and a tail of 3; 50 % 3 == 2 are trimmed
    full = [b for b in LengthGroupedSampler(lengths, bs, seed=3, epoch=EPOCH).batches() if len(b) == bs]
    epoch = trimmed(full, world_size)
    assert len(epoch) == (48 if world_size == 3 else 50)
    shares = [list(grouped(lengths, bs, r, world_size)) for r in range(world_size)]
    for rank, share in enumerate(shares):
        assert share == flat(epoch[rank::world_size])  # whole batches, every world_size-th one
        assert len(share) == len(grouped(lengths, bs, rank, world_size)) == len(epoch) // world_size * bs
    assert len({len(s) for s in shares}) == 1  # equal shares: no rank waits at the epoch's end
    seen = flat(shares)
    assert len(set(seen)) == len(seen) and sorted(seen) == sorted(flat(epoch))


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_grouped_global_position_resumes_every_rank_without_repeat_or_gap(world_size):
    lengths, bs = lengths_of(203), 4
    shares = [list(grouped(lengths, bs, r, world_size)) for r in range(world_size)]
    rounds = len(shares[0]) // bs
    for done in (0, 1, 5, rounds - 1, rounds):
        start = done * bs * world_size  # what BatchStream counts: batch_size x world_size per micro-batch
        for rank in range(world_size):
            resumed = grouped(lengths, bs, rank, world_size, start)
            assert shares[rank][: done * bs] + list(resumed) == shares[rank]
            assert len(resumed) == len(shares[rank]) - done * bs
    past = grouped(lengths, bs, 0, world_size, 10**6)  # past the epoch's end: nothing, not a negative length
    assert list(past) == [] and len(past) == 0


def test_grouped_on_one_process_yields_the_batches_it_did_before():
    """Before ranks, GroupedSampler yielded the whole grouped order from `start` and the
    DataLoader's drop_last cut the short tail batch: the batches must be the same."""
    lengths, bs = lengths_of(203), 4
    order = flat(LengthGroupedSampler(lengths, bs, seed=3, epoch=EPOCH).batches())
    for start in (0, 8, 40, 200):
        before = order[start:]
        before = [before[i : i + bs] for i in range(0, len(before) - len(before) % bs, bs)]
        now = list(grouped(lengths, bs, start=start))
        assert [now[i : i + bs] for i in range(0, len(now), bs)] == before


# ---- TOKEN_BUDGET ------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [2, 3])
def test_budget_batches_are_dealt_in_turn_and_round_rows_walks_the_rounds(world_size):
    lengths = lengths_of(400, seed=1)
    batches = TokenBudgetBatchSampler(lengths, 600, seed=5, epoch=EPOCH).batches()
    epoch = trimmed(batches, world_size)
    shares = [list(budget(lengths, r, world_size)) for r in range(world_size)]
    for rank, share in enumerate(shares):
        assert share == epoch[rank::world_size] and len(budget(lengths, rank, world_size)) == len(share)
    assert len({len(s) for s in shares}) == 1
    seen = flat(flat(shares))
    assert len(set(seen)) == len(seen) and sorted(seen) == sorted(flat(epoch))
    assert len({len(b) for b in epoch}) > 1  # rows vary: why positions need round_rows

    sampler, position = budget(lengths, 0, world_size), 0
    for done in range(len(shares[0])):
        rows = sampler.round_rows(position)
        assert rows == sum(len(b) for b in epoch[done * world_size : (done + 1) * world_size]) > 0
        for rank in range(world_size):  # a run resumed at this position: exactly the rest
            resumed = budget(lengths, rank, world_size, position)
            assert list(resumed) == shares[rank][done:] and len(resumed) == len(shares[rank]) - done
        if done:  # off a boundary (a position from another world size): that round counts as read
            assert list(budget(lengths, 0, world_size, position - 1)) == shares[0][done:]
            assert sampler.round_rows(position - 1) == 1 + rows
        position += rows
    assert position == len(flat(epoch)) and list(budget(lengths, 0, world_size, position)) == []
    with pytest.raises(ValueError, match="past the epoch"):
        sampler.round_rows(position)


def test_budget_on_one_process_yields_the_batches_it_did_before_and_resumes_exactly():
    lengths = lengths_of(400, seed=1)
    batches = TokenBudgetBatchSampler(lengths, 600, seed=5, epoch=EPOCH).batches()
    position = 0
    for done in range(len(batches) + 1):
        # before ranks: every batch from the first one whose preceding rows reach start
        assert list(budget(lengths, start=position)) == batches[done:]
        if done < len(batches):
            assert budget(lengths).round_rows(position) == len(batches[done])
            position += len(batches[done])


# ---- a real 2-process run ----------------------------------------------------------------


@pytest.mark.parametrize(
    "batching",
    [{"LENGTH_GROUPING": "1"}, {"TOKEN_BUDGET": "160", "SHARDING": "zero2"}],
    ids=["grouped", "budget"],
)
def test_two_process_sft_through_the_launcher(batching, base_model, tmp_path):
    records = [{"prompt": f"Item {i}.", "response": "the quick fox " * (1 + (i * 7) % 9)} for i in range(48)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    env = {"NPROC_PER_NODE": "2", "MODEL_PATH": str(base_model), "DATA_PATH": str(data),
           "OUTPUT_DIR": str(tmp_path / "runs"), "RUN_NAME": "two", "MAX_LENGTH": "64", "GRADIENT_ACCUM": "2",
           "MAX_STEPS": "3", "NUM_WORKERS": "0", "LOG_EVERY": "1", "SAVE_EVERY": "1", "KEEP_CHECKPOINTS": "3",
           **batching}  # fmt: skip
    result = launch("train_sft_custom.sh", env, "4", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["latest", "two"]  # one set of outputs
    run = tmp_path / "runs" / "two"
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["mode"], summary["world_size"], summary["steps"]) == ("sft", 2, 3)
    assert summary["padding_efficiency"] > 0.8 and summary["final_loss"] > 0
    decisions = {d["setting"]: d for d in json.loads((run / "config.json").read_text())["decisions"]}
    if "TOKEN_BUDGET" in batching:  # rows vary: the mean micro-batch x accumulation x processes
        assert summary["token_budget"] == 160 and decisions["parallel"]["value"] == "zero2"
        assert summary["effective_batch_size"] == pytest.approx(summary["batch_size"] * 2 * 2, abs=0.02)
        assert summary["tokens"] <= summary["samples"] * 64
    else:
        assert summary["length_grouping"] and decisions["parallel"]["value"] == "ddp"
        assert summary["effective_batch_size"] == 4 * 2 * 2 and summary["samples"] == 3 * 16
    assert "2 processes, each reading its own 1/2" in decisions["total_steps"]["reason"]
    log = (run / "train.log").read_text()
    assert ("(TOKEN_BUDGET=160) x accum 2 x 2 processes = effective ~" if "TOKEN_BUDGET" in batching
            else "batch 4 x accum 2 x 2 processes = effective 16") in log  # fmt: skip
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r] == [1, 2, 3]
    assert result.stdout.count("done:") == 1  # rank 0 alone prints
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(run / "final", local_files_only=True).num_parameters() > 0

    if "TOKEN_BUDGET" not in batching:  # grouped positions resume exactly: the unit tests above, per rank
        return
    # A copy stopped after step 1, resumed on 2 processes: every rank's position (and RNG) is
    # restored, so steps 2-3 read the same rows and reach the same losses.
    again = tmp_path / "runs" / "again"
    shutil.copytree(run, again, symlinks=True)
    for path in list_checkpoints(again / "checkpoints")[:-1]:
        shutil.rmtree(path)
    shutil.rmtree(again / "final")
    (again / "summary.json").unlink()
    resumed = launch("train_sft_custom.sh", {**env, "RUN_NAME": "again", "RESUME": "1"}, "4", timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((again / "summary.json").read_text())["resumed_from_step"] == 1

    def rows(folder):
        return [
            (r["step"], r["samples"], r["tokens"])
            for r in read_jsonl(folder / "metrics.jsonl")
            if "loss" in r
        ]

    def losses(folder):
        return [r["loss"] for r in read_jsonl(folder / "metrics.jsonl") if "loss" in r]

    assert rows(again) == rows(run)
    np.testing.assert_allclose(losses(again), losses(run), rtol=0, atol=1e-5)
