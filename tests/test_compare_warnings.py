"""`make compare` at small budgets (issue 28, item 7): a side with fewer than 5 steady-state steps
is called a guess; different optimizer steps or tokens are said (final losses then do not
compare); SFT leads with tokens/s; compare.png on CPU has no empty memory panel and a single run
is not a "median"; length grouping under a sample budget trains the samples a plain order does."""

from __future__ import annotations

import json

import numpy as np

from conftest import run_cli
from train.data.chat.batching import GroupedSampler
from train.data.text import EpochSampler
from train.observe.compare import compare_runs, render_markdown
from train.observe.curves import comparison_panels, throughput_label

BASE = dict(
    device="cpu",
    device_name="x86_64",
    world_size=1,
    model_size="nano",
    max_length=64,
    precision="fp32",
    num_workers=0,
    peak_vram_mb=None,
    vram_total_mb=None,
    avg_gpu_util=None,
    mfu=None,
    exit_reason="completed",
)


def run_folder(tmp_path, name, **summary):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "summary.json").write_text(json.dumps({**BASE, "run_name": name, **summary}))
    rows = [{"step": s, "samples": 8 * s, "loss": 6.0 - 0.1 * s} for s in range(1, 4)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def pretrain_pair(tmp_path, a_steady, b_steady, b_steps=2, b_tokens=16_384):
    a = run_folder(
        tmp_path,
        "baseline",
        mode="pretrain",
        batch_size=8,
        gradient_accumulation_steps=1,
        steps=32,
        samples=256,
        tokens=16_384,
        steady_state_steps=a_steady,
        samples_per_sec=10.0,
        tokens_per_sec=640.0,
        final_loss=5.0,
    )
    b = run_folder(
        tmp_path,
        "optimized",
        mode="pretrain",
        batch_size=32,
        gradient_accumulation_steps=4,
        steps=b_steps,
        samples=256,
        tokens=b_tokens,
        steady_state_steps=b_steady,
        samples_per_sec=20.5,
        tokens_per_sec=1312.0,
        final_loss=6.0,
    )
    return a, b


def test_few_steady_steps_and_different_steps_are_said(tmp_path, capsys):
    a, b = pretrain_pair(tmp_path, a_steady=29, b_steady=1, b_tokens=15_000)
    result = compare_runs([a, b])
    notes = result["notes"]
    assert result["metric"] == "samples_per_sec" and result["verdict"] == ("optimized is 2.05x baseline "
                                                                           "(samples/s)")
    guesses = [n for n in notes if "steady-state step" in n]
    assert guesses == [
        "optimized has 1 steady-state step(s), fewer than 5: its samples/s and the speed-up are a guess; "
        "train longer (COMPARE_SAMPLES, MAX_STEPS)"]  # the baseline's 29 are enough
    assert ("the sides trained different numbers of optimizer steps (32 vs 2): their final losses are not "
            "comparable") in notes
    assert ("the sides trained different numbers of tokens (16,384 vs 15,000): their final losses are not "
            "comparable") in notes
    table = render_markdown(result)
    assert "| optimizer steps / tokens | 32 / 16,384 | 2 / 15,000 |" in table
    assert "note: optimized has 1 steady-state step(s)" in table

    # the CLI writes the same notes, and compare.png without an empty memory panel on CPU
    out = tmp_path / "cmp"
    assert run_cli("compare", str(a), str(b), "--out", str(out)) == 0
    assert "fewer than 5" in capsys.readouterr().out
    assert (out / "compare.png").stat().st_size > 0 and "fewer than 5" in (out / "compare.md").read_text()
    assert comparison_panels(result) == ("throughput", "loss")
    assert throughput_label(result) == "samples/s"  # one run per side: no "median"


def test_like_for_like_sides_get_no_warning(tmp_path):
    a, b = pretrain_pair(tmp_path, a_steady=29, b_steady=5, b_steps=32)
    result = compare_runs([a, b])
    assert result["notes"] == []
    gpu = {**result, "runs": [{**e, "peak_vram_mb": 900.0} for e in result["runs"]]}
    assert comparison_panels(gpu) == ("throughput", "memory", "loss")
    assert (
        throughput_label({**result, "runs": [{**e, "n": 3} for e in result["runs"]]})
        == "samples/s (median of 3 runs)"
    )


def test_sft_leads_with_tokens_per_second(tmp_path):
    common = dict(mode="sft", samples=64, tokens=7_181, steps=64, steady_state_steps=50)
    a = run_folder(tmp_path, "sft-batch1", batch_size=1, gradient_accumulation_steps=1, samples_per_sec=2.0,
                   tokens_per_sec=200.0, final_loss=4.0, **common)
    b = run_folder(tmp_path, "sft-fast", batch_size=16, gradient_accumulation_steps=2, samples_per_sec=17.44,
                   tokens_per_sec=558.0, final_loss=4.5, **{**common, "steps": 2, "steady_state_steps": 1})
    result = compare_runs([a, b])
    assert result["metric"] == "tokens_per_sec"
    assert result["verdict"] == "sft-fast is 2.79x sft-batch1 (tokens/s); 8.72x in samples/s"
    table = render_markdown(result).splitlines()
    assert table[2].startswith("| tokens/s | 200.0 | 558.0 |") and table[3].startswith("| samples/s |")
    assert "| speed-up | 1.00x | 2.79x |" in table
    assert any("sft-fast has 1 steady-state step(s)" in n and "tokens/s" in n for n in result["notes"])
    assert not any("numbers of tokens" in n for n in result["notes"])  # the same tokens: no note
    assert throughput_label(result) == "tokens/s"


def test_length_grouping_under_a_budget_trains_the_plain_order_samples():
    """make compare-sft: batch 1 in the plain epoch order against 16 x 2 length-grouped. With
    the run's sample budget the grouped side batches exactly the samples the plain one trains;
    before, it drew its batches from the whole epoch (7,181 vs 6,536 tokens)."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(5, 200, size=1000)
    budget = 96
    plain = list(EpochSampler(len(lengths), 1337))[:budget]
    grouped = GroupedSampler(lengths, 16, seed=1337, budget=budget)
    taken = list(grouped)[:budget]
    assert sorted(taken) == sorted(plain) and taken != plain  # the same samples, batched by length
    assert int(lengths[taken].sum()) == int(lengths[plain].sum())
    batches = [taken[i : i + 16] for i in range(0, budget, 16)]
    spread = np.mean([np.ptp(lengths[b]) for b in batches])
    # still grouped
    assert spread < np.mean([np.ptp(lengths[plain[i : i + 16]]) for i in range(0, budget, 16)]) / 2
    rest = list(grouped)[budget:]
    assert len(rest) == 1000 // 16 * 16 - budget and not set(rest) & set(taken)  # the epoch goes on past it
    # no budget: the same epoch size
    assert len(list(GroupedSampler(lengths, 16, seed=1337))) == len(rest) + budget
