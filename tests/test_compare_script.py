"""`make compare` (scripts/compare.sh): which launcher gets which settings, in what order, and the
table at the end; and that the two sides of a compare train on the same sequences.

The script runs in a copy of the kit whose .venv/bin/python records each training command and
writes the run's summary.json instead of training (a real compare takes minutes on 2 cores; the
launchers, common.sh and `python -m train compare` are the real ones). The real chain is run by
`make compare` itself.
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import ROOT, read_jsonl
from train.data import text as data
from train.data.loader import make_loader

# Stands in for .venv/bin/python: `-m train compare` runs for real; a training command is recorded
# and leaves a summary.json whose samples/s is read from SPEEDS (a queue per preset).
FAKE_PYTHON = """#!{python}
import json, os, sys
from pathlib import Path

kit = Path(__file__).resolve().parents[2]
args = sys.argv[1:]
if args[:2] != ["-m", "train"] or args[2:3] == ["compare"]:  # common.sh's knob lists, compare: real
    os.execv({python!r}, [{python!r}, *args])
flags = dict(zip(args[3::2], args[4::2]))
with open(kit / "calls.jsonl", "a") as f:
    f.write(json.dumps({{"argv": args}}) + "\\n")
speeds = json.loads((kit / "speeds.json").read_text())
sps = speeds[flags["--preset"]].pop(0)
(kit / "speeds.json").write_text(json.dumps(speeds))
run = Path(flags["--output_dir"]) / flags["--run_name"]
run.mkdir(parents=True, exist_ok=True)
batch, accum = int(flags.get("--batch_size", 8)), int(flags.get("--gradient_accumulation_steps", 1))
(run / "summary.json").write_text(json.dumps({{
    "run_name": run.name, "samples_per_sec": sps, "samples": int(flags["--max_samples"]),
    "batch_size": batch, "gradient_accumulation_steps": accum, "effective_batch_size": batch * accum,
    "precision": flags.get("--precision", "fp32"), "model_size": flags.get("--model_size"),
    "final_loss": 4.0, "exit_reason": "completed"}}))
"""


@pytest.fixture
def kit(tmp_path):
    """A copy of the kit's shell side with the recording python."""
    root = tmp_path / "kit"
    (root / "scripts").mkdir(parents=True)
    for name in (
        "run_single_gpu.sh",
        "run_single_gpu_optimized.sh",
        "scripts/common.sh",
        "scripts/compare.sh",
    ):
        shutil.copy2(ROOT / name, root / name)
    for name in ("train", "config.py"):
        (root / name).symlink_to(ROOT / name)
    (root / ".venv" / "bin").mkdir(parents=True)
    fake = root / ".venv" / "bin" / "python"
    fake.write_text(FAKE_PYTHON.format(python=sys.executable))
    fake.chmod(0o755)
    return root


def compare(kit, env, *args):
    base = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR")}
    base.update({"OUTPUT_DIR": str(kit / "runs"), "DEVICE": "cpu", **env})
    return subprocess.run(["bash", str(kit / "scripts" / "compare.sh"), *args], env=base,
                          capture_output=True, text=True, timeout=120, cwd=kit)


def recorded_flags(kit) -> list[dict]:
    """The flags of each recorded `python -m train <mode> --flag value ...`, in call order."""
    rest = [call["argv"][3:] for call in read_jsonl(kit / "calls.jsonl")]
    return [dict(zip(r[::2], r[1::2], strict=True)) for r in rest]


def test_repeats_alternate_and_only_the_optimized_side_is_tuned(kit):
    (kit / "speeds.json").write_text(json.dumps({"baseline": [10.0, 12.0], "optimized": [30.0, 34.0]}))
    env = {"REPEAT": "2", "COMPARE_SAMPLES": "256", "MODEL_SIZE": "nano", "SEED": "7",
           "BATCH_SIZE": "16", "PRECISION": "bf16"}
    result = compare(kit, env)
    assert result.returncode == 0, result.stderr

    flags = recorded_flags(kit)
    assert [(f["--preset"], f["--run_name"]) for f in flags] == [
        ("baseline", "compare-baseline-r1"), ("optimized", "compare-optimized-r1"),
        ("baseline", "compare-baseline-r2"), ("optimized", "compare-optimized-r2"),
    ]
    for f in flags:  # shared: model, seed, budget; every run replaces its previous folder
        assert (f["--model_size"], f["--seed"], f["--max_samples"], f["--overwrite"]) == (
            "nano",
            "7",
            "256",
            "1",
        )
    base, opt = flags[0], flags[1]
    assert base["--batch_size"] == "8" and "--precision" not in base  # the guides' "before"
    assert opt["--batch_size"] == "16" and opt["--precision"] == "bf16"

    out = kit / "runs" / "compare" / "compare-baseline_vs_compare-optimized"
    assert sorted(p.name for p in out.iterdir()) == ["compare.json", "compare.md", "compare.png"]
    assert "| compare-baseline (x2) | compare-optimized (x2) |" in result.stdout
    assert "| speed-up | 1.00x | 2.91x |" in result.stdout  # median 32 over median 11
    assert f"comparison written to {out}/" in result.stdout
    table = json.loads((out / "compare.json").read_text())
    assert [e["runs"] for e in table["runs"]] == [
        ["compare-baseline-r1", "compare-baseline-r2"], ["compare-optimized-r1", "compare-optimized-r2"]]


def test_budget_must_fit_both_batches(kit):
    result = compare(kit, {"COMPARE_SAMPLES": "1000"})
    assert result.returncode == 2 and not (kit / "calls.jsonl").exists()
    assert "COMPARE_SAMPLES=1000 is not a multiple of 128" in result.stderr and "try 1024" in result.stderr
    result = compare(kit, {"MAX_STEPS": "5"})
    assert result.returncode == 2 and "set COMPARE_SAMPLES" in result.stderr


def test_sft_needs_the_sft_launchers_then_runs_batch_1_first(kit):
    result = compare(kit, {"COMPARE_SAMPLES": "64"}, "sft")
    assert result.returncode == 2 and "train_sft_custom.sh" in result.stderr

    # SFT launchers in the guides' shape: the custom one takes the micro-batch as its argument.
    for name, preset, batch, accum in (("train_sft_custom.sh", "baseline", "", ""),
                                       ("quick_start_sft_fast.sh", "optimized", "16", "2")):
        script = kit / name
        script.write_text(
            "#!/usr/bin/env bash\nset -euo pipefail\n"
            f"BATCH_SIZE=${{BATCH_SIZE:-{batch or '${1:-8}'}}}\n"
            f"GRADIENT_ACCUM=${{GRADIENT_ACCUM:-{accum or 1}}}\n"
            'source "$(dirname "$0")/scripts/common.sh"\n'
            f'kit_launch sft {preset} "${{@:2}}"\n'
        )
        script.chmod(0o755)
    (kit / "speeds.json").write_text(json.dumps({"baseline": [2.0], "optimized": [16.0]}))
    result = compare(kit, {"COMPARE_SAMPLES": "64", "BATCH_SIZE": "16"}, "sft")
    assert result.returncode == 0, result.stderr
    flags = recorded_flags(kit)
    assert [(f["--run_name"], f["--batch_size"], f["--gradient_accumulation_steps"]) for f in flags] == [
        ("compare-sft-batch1", "1", "1"), ("compare-sft-fast", "16", "2")]
    assert "| speed-up | 1.00x | 8.00x |" in result.stdout


def test_both_sides_train_on_the_same_sequences(tmp_path):
    """Same seed, same data: the baseline (8 per step) and the optimized side (32 x 4 = 128 per
    step, with workers) read the same permutation, so a budget that is a multiple of 128 gives
    both exactly the same sequences, in the same order."""
    from types import SimpleNamespace

    from train.data.stream import BatchStream

    tokens = tmp_path / "tokens.bin"
    np.arange(40_000, dtype=np.uint16).tofile(tokens)
    dataset = data.PackedDataset(np.memmap(tokens, dtype=np.uint16, mode="r"), 16)

    def seen(batch_size, workers, budget):
        cfg = SimpleNamespace(num_workers=workers, prefetch_factor=2 if workers else None,
                              pin_memory=False, persistent_workers=False)
        loader, sampler = make_loader(dataset, cfg, batch_size, 1337, torch.device("cpu"))
        stream, rows = BatchStream(loader, sampler, batch_size), []
        while len(rows) < budget:
            rows.extend(next(stream)["input_ids"])
        return torch.stack(rows)

    baseline = seen(8, 0, 256)
    optimized = seen(32, 2, 256)
    assert torch.equal(baseline, optimized)
    assert len({tuple(r.tolist()) for r in baseline}) == 256  # distinct sequences, not one repeated
