"""PACKING=1 in preference training: a pair's chosen and rejected sequences side by side in packed rows
(the data front door's PackedPairCollator), position_ids restarting per sequence, attention never
across sequences (varlen_sdpa's flat row, or sdpa's block-diagonal mask), and the per-sequence
log-prob sums read from sequence_ids. Packed equals the padded 2P rows to 1e-5 (loss, every metric,
every gradient) on tiny GPT-2 and Llama models, and a whole `python -m train dpo` run with PACKING=1
gives the losses of one without, step by step, when each step reads the same pairs: PACKING's batch
unit is a packed row, so BATCH_SIZE rows hold a varying number of pairs; with BATCH_SIZE = the rows
of the data set (and BATCH_SIZE = the pairs unpacked) every step reads every pair. A T5's pairs are
not packed (nor are SFT's): one line, exit 2.

PACKING empty (the default) packs each micro-batch instead (MicroPackedPairCollator): BATCH_SIZE pairs, drawn
as the padded run draws them, in one unpadded row; so a default run gives the losses of PACKING=0 at
any BATCH_SIZE, step by step, and its padding efficiency is 1 on a CPU, >= 0.9 in the CUDA form (the row
rounded up to 8 tokens) on short pairs and on LLaMA-Factory-shaped ones (prompts 20-600, replies
10-400 tokens), where padding keeps about half."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from preference_tools import CPU, TOL, build_reference, gpt2, llama, pairs_of, preference_loss
from test_dpo_mode import t5_root  # noqa: F401 (the tiny T5 and its pairs)

from conftest import read_jsonl, run_cli
from train.core.attention import use_attention
from train.core.preference.logps import Responses
from train.data.chat.packing import SDPA, VARLEN
from train.data.chat.pair_batching import MicroPackedPairCollator, PackedPairCollator, PairCollator
from train.models.family import CAUSAL_LM

KNOBS = {
    "sigmoid": dict(beta=0.5, label_smoothing=0.1, sft_weight=0.3),
    "simpo": dict(beta=2.0, simpo_gamma=0.7),
}
FAMILIES = {"gpt2": gpt2, "llama": llama}


def examples(n: int, seed: int) -> list[dict]:
    """Encoded pairs as the preference cache holds them (the chosen side's first token untrained,
    as a template's header token would be)."""
    out = []
    for prompt, chosen, rejected in pairs_of(n, seed):
        out.append(
            {
                "prompt_ids": prompt.tolist(),
                "chosen_ids": chosen.tolist(),
                "rejected_ids": rejected.tolist(),
                "chosen_labels": [-100, *chosen.tolist()[1:]],
                "rejected_labels": rejected.tolist(),
            }
        )
    return out


def grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


CASES = [(family, loss, VARLEN) for family in ("gpt2", "llama") for loss in KNOBS] + [
    ("gpt2", "sigmoid", SDPA),
    ("llama", "simpo", SDPA),
]  # the masked form: a block-diagonal (rows, 1, T, T) mask


def losses_and_grads(family: str, loss_name: str, attention: str, batches: list[dict]) -> list[tuple]:
    """(loss, metrics, gradients) of each batch, each on a fresh copy of one policy (and one reference)."""
    policy, other = FAMILIES[family](0), FAMILIES[family](1)
    for model in (policy, other):
        use_attention(model, VARLEN if attention == VARLEN else SDPA)
    reference = build_reference("copy", other) if loss_name != "simpo" else None
    results = []
    for batch in batches:
        model = copy.deepcopy(policy)
        loss, metrics = preference_loss(model, batch, CPU, "fp32", reference=reference, chunk_tokens=4,
                                        loss=loss_name, **KNOBS[loss_name])  # fmt: skip
        loss.backward()
        results.append((loss.item(), metrics, grads(model)))
    return results


def assert_same(results: list[tuple]) -> None:
    (loss_a, metrics_a, grads_a), (loss_b, metrics_b, grads_b) = results
    assert loss_b == pytest.approx(loss_a, abs=TOL)
    assert metrics_a.keys() == metrics_b.keys() and len(metrics_a) >= 6
    for name in metrics_a:
        assert metrics_b[name].item() == pytest.approx(metrics_a[name].item(), abs=TOL), name
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], atol=TOL, rtol=TOL, msg=name)


@pytest.mark.parametrize("family, loss_name, attention", CASES)
def test_a_packed_micro_batch_equals_the_padded_one(family, loss_name, attention):
    """PACKING empty: the micro-batch's pairs in their own order, one flat row (varlen) or a row per pair
    (the masked form); with widths (CUDA, COMPILE=1) the flat row pads to a multiple of 8, unread."""
    pairs = examples(5, seed=4)
    packed = MicroPackedPairCollator(0, attention=attention)
    if attention == VARLEN:
        packed.widths = (16, 64)
    batch = packed(pairs)
    real = sum(2 * len(p["prompt_ids"]) + len(p["chosen_ids"]) + len(p["rejected_ids"]) for p in pairs)
    assert batch["n_pairs"] == 5 and batch["n_real_tokens"] == real
    if attention == VARLEN:
        assert (
            batch["labels"].shape == (1, batch["n_padded_tokens"])
            and batch["n_padded_tokens"] == -(-real // 8) * 8
        )
    else:
        assert batch["labels"].shape[0] == 5  # a row per pair
    assert_same(losses_and_grads(family, loss_name, attention, [PairCollator(0)(pairs), batch]))


def lf_shaped(n: int, seed: int) -> list[dict]:
    """Pairs shaped as LLaMA-Factory's dpo_en_demo: prompts of 20-600 tokens, replies of 10-400."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        prompt, chosen, rejected = rng.integers(20, 601), rng.integers(10, 401), rng.integers(10, 401)
        out.append({"prompt_ids": [5] * prompt, "chosen_ids": [6] * chosen, "rejected_ids": [7] * rejected,
                    "chosen_labels": [6] * chosen, "rejected_labels": [7] * rejected})  # fmt: skip
    return out


@pytest.mark.parametrize("shape", ["short", "llama-factory"])
def test_micro_batch_packing_keeps_the_padding_out(shape):
    """Padding efficiency over every micro-batch of 8 (real tokens / tokens run): padded, packed on a CPU,
    packed in the CUDA form."""
    pairs = examples(400, seed=5) if shape == "short" else lf_shaped(400, seed=5)
    order = np.random.default_rng(0).permutation(len(pairs))
    batches = [[pairs[i] for i in order[k : k + 8]] for k in range(0, len(pairs), 8)]
    cuda = MicroPackedPairCollator(0, attention=VARLEN, pad_to_multiple_of=8)
    cuda.widths = (64, 128)

    def efficiency(collate) -> float:
        counts = [collate(b) for b in batches]
        return sum(c["n_real_tokens"] for c in counts) / sum(c["n_padded_tokens"] for c in counts)

    padded = efficiency(PairCollator(0))
    assert padded < 0.8
    assert efficiency(MicroPackedPairCollator(0, attention=VARLEN)) == 1.0
    assert efficiency(cuda) >= 0.9 > padded + 0.2


@pytest.mark.parametrize("family, loss_name, attention", CASES)
def test_packed_rows_equal_the_padded_pairs(family, loss_name, attention):
    pairs = examples(5, seed=3)
    rows = [[pairs[0], pairs[1]], [pairs[2]], [pairs[3], pairs[4]]]  # pack_pairs' rows: whole pairs
    padded = PairCollator(0)(pairs)  # the same pairs in the packed order (row by row)
    packed = PackedPairCollator(0, attention=attention)(rows)
    assert packed["n_pairs"] == 5 and packed["labels"].shape[0] == (1 if attention == VARLEN else 3)
    host = Responses.of(packed, shifted=True)
    assert host.counts.tolist() == Responses.of(padded, shifted=True).counts.tolist()

    policy, other = FAMILIES[family](0), FAMILIES[family](1)
    for model in (policy, other):
        use_attention(model, VARLEN if attention == VARLEN else SDPA)
    reference = build_reference("copy", other) if loss_name != "simpo" else None
    twin = copy.deepcopy(policy)
    results = []
    for model, batch in ((policy, padded), (twin, packed)):
        loss, metrics = preference_loss(model, batch, CPU, "fp32", reference=reference, chunk_tokens=4,
                                        loss=loss_name, **KNOBS[loss_name])  # fmt: skip
        loss.backward()
        results.append((loss.item(), metrics, grads(model)))
    assert_same(results)


def test_a_sequence_never_sees_another():
    """The same pair alone in a row, or packed after another pair: the same log-probs (positions
    restart, attention stays inside the sequence)."""
    from train.core.preference.logps import device_inputs, sequence_logps

    model = gpt2(0)
    use_attention(model, VARLEN)
    first, second = examples(2, seed=9)

    def sums(rows):
        batch = PackedPairCollator(0, attention=VARLEN)(rows)
        with torch.no_grad():
            return sequence_logps(model, device_inputs(batch, CPU), Responses.of(batch, shifted=True),
                                  layout=CAUSAL_LM)  # fmt: skip

    alone, behind = sums([[second]]), sums([[first, second]])
    torch.testing.assert_close(behind[[1, 3]], alone, atol=TOL, rtol=0)


@pytest.mark.parametrize("attention", [VARLEN, SDPA])
def test_no_host_sync_in_a_packed_micro_step(attention):
    """The per-sequence sums read sequence_ids on the host (Responses.of) and add on the device: forward
    and backward read nothing back (the counter plays the GPU on the CPU)."""
    from train.core.measure.syncs import HostSyncs

    pairs = examples(4, seed=7)
    policy, other = gpt2(0), gpt2(1)
    for model in (policy, other):
        use_attention(model, attention)
    reference = build_reference("copy", other)
    batches = iter([PackedPairCollator(0, attention=attention)([pairs[:3], pairs[3:]])])
    with HostSyncs("cpu") as syncs:
        batch = next(syncs.host_batches(batches))
        loss, _ = preference_loss(policy, batch, CPU, "fp32", reference=reference, sft_weight=0.2)
        loss.backward()
    assert syncs.count == 0, syncs.summary()


# ---- whole runs --------------------------------------------------------------------------

PAIRS = [
    {"prompt": f"Say {i}.", "chosen": f"{i} {i}.", "rejected": f"no {i % 5} way" * (1 + i % 3)}
    for i in range(12)
]


@pytest.fixture(scope="module")
def pairs_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dpo_packing")
    (root / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    return root


def dpo(root: Path, model: Path, name: str, *more: str) -> Path:
    argv = ["dpo", "--model_path", str(model), "--data_path", str(root / "pairs.jsonl"), "--output_dir",
            str(root / "runs"), "--cache_dir", str(root / "cache"), "--max_length", "64", "--max_steps", "3",
            "--log_every", "1", "--num_workers", "0", "--val_fraction", "0", "--learning_rate", "1e-3",
            "--run_name", name, "--overwrite", "1", *more]  # fmt: skip
    assert run_cli(*argv) == 0
    return root / "runs" / name


def test_a_packed_run_gives_the_losses_of_an_unpacked_one(base_model, pairs_root, capsys):
    """Every step reads all 12 pairs: 12 unpacked rows of pairs, or every packed row."""
    dry = dpo(pairs_root, base_model, "dry", "--packing", "1", "--batch_size", "1", "--dry_run", "1")
    assert not (dry / "summary.json").exists()
    out = capsys.readouterr().out
    rows = int(out.split("packing = ")[1].split(" rows")[0])
    assert rows < len(PAIRS)  # pairs share rows
    runs = {
        "padded": dpo(
            pairs_root,
            base_model,
            "padded",
            "--packing",
            "0",
            "--reference",
            "copy",
            "--batch_size",
            str(len(PAIRS)),
        )
    }
    for reference in ("copy", "precomputed"):
        runs[reference] = dpo(pairs_root, base_model, f"packed-{reference}", "--packing", "1", "--reference",
                              reference, "--batch_size", str(rows))  # fmt: skip
    expected = read_jsonl(runs["padded"] / "metrics.jsonl")
    names = [k for k in expected[0] if k == "loss" or k.startswith(("rewards/", "logps/"))]
    assert len(names) == 7
    for reference in ("copy", "precomputed"):
        summary = json.loads((runs[reference] / "summary.json").read_text())
        assert summary["packing"] and summary["attention"] == VARLEN and summary["packed_rows"] == rows
        assert summary["samples"] == 3 * len(PAIRS)  # pairs, whatever the rows
        got = [r for r in read_jsonl(runs[reference] / "metrics.jsonl") if "loss" in r]
        assert [r["step"] for r in got] == [1, 2, 3]
        for name in names:
            np.testing.assert_allclose([r[name] for r in got], [r[name] for r in expected if "loss" in r],
                                       rtol=0, atol=1e-5, err_msg=f"{reference} {name}")  # fmt: skip
    assert expected[-1]["loss"] < expected[0]["loss"]  # it trains: the comparison is not of constants


def test_t5_pairs_are_not_packed(t5_root, capsys):  # noqa: F811
    argv = [
        "dpo",
        "--model_path",
        str(t5_root / "model"),
        "--data_path",
        str(t5_root / "pairs.jsonl"),
        "--output_dir",
        str(t5_root / "runs"),
        "--cache_dir",
        str(t5_root / "cache"),
        "--template",
        "none",
        "--packing",
        "1",
        "--max_steps",
        "1",
        "--run_name",
        "packed",
    ]
    assert run_cli(*argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1 and "PACKING=1" in err[0] and "encoder-decoder" in err[0] and "not built" in err[0]
    ), err
    assert not (t5_root / "runs" / "packed").exists()



def test_a_default_run_packs_each_micro_batch_and_gives_the_padded_losses(base_model, pairs_root, capsys):
    """PACKING empty against PACKING=0 at BATCH_SIZE 4 (3 steps of different pairs): the same losses and
    metrics step by step, the decision said with its reason, no pad token read."""
    runs = {"padded": dpo(pairs_root, base_model, "micro-padded", "--packing", "0", "--reference", "copy",
                          "--batch_size", "4")}  # fmt: skip
    assert "packing = micro-batch" not in capsys.readouterr().out
    for reference in ("copy", "precomputed"):
        runs[reference] = dpo(pairs_root, base_model, f"micro-{reference}", "--reference", reference,
                              "--batch_size", "4")  # fmt: skip
        out = capsys.readouterr().out
        assert "packing = micro-batch  (PACKING empty: each micro-batch's BATCH_SIZE pairs" in out
        assert f"attention = {VARLEN}" in out
    padded = json.loads((runs["padded"] / "summary.json").read_text())
    assert padded["packing"] is False and padded["padding_efficiency"] < 0.85
    expected = read_jsonl(runs["padded"] / "metrics.jsonl")
    names = [k for k in expected[0] if k == "loss" or k.startswith(("rewards/", "logps/"))]
    for reference in ("copy", "precomputed"):
        summary = json.loads((runs[reference] / "summary.json").read_text())
        assert summary["packing"] == "micro-batch" and summary["attention"] == VARLEN
        assert summary["padding_efficiency"] == 1.0 and summary["samples"] == summary["steps"] * 4 == 12
        got = [r for r in read_jsonl(runs[reference] / "metrics.jsonl") if "loss" in r]
        assert [r["step"] for r in got] == [1, 2, 3]
        for name in names:
            np.testing.assert_allclose([r[name] for r in got], [r[name] for r in expected if "loss" in r],
                                       rtol=0, atol=1e-5, err_msg=f"{reference} {name}")  # fmt: skip
    assert len({round(r["loss"], 6) for r in expected if "loss" in r}) == 3  # three different steps


@pytest.mark.parametrize("more", [["--token_budget", "200"], ["--length_grouping", "1", "--batch_size", "4"]])
def test_the_default_packing_takes_the_other_samplers(base_model, pairs_root, more):
    """TOKEN_BUDGET and LENGTH_GROUPING choose the pairs of a micro-batch; PACKING empty still lays them out
    without padding."""
    run = dpo(pairs_root, base_model, "micro-" + more[0].strip("-"), "--reference", "copy", *more)
    summary = json.loads((run / "summary.json").read_text())
    assert (
        summary["packing"] == "micro-batch" and summary["padding_efficiency"] == 1.0 and summary["steps"] == 3
    )
