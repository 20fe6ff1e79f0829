"""Golden comparison of two source trees: the same seeded tiny CPU runs in each, compared key by key.

    .venv/bin/python bench/golden_compare.py BASE_TREE NEW_TREE [--work DIR] [--only a,b] [--expect-diff a,b]

A refactor that keeps behaviour leaves config.json, summary.json and every metrics.jsonl row the
same. Each scenario runs in its own process with the tree's `train` package first on sys.path and
one thread (so the numbers repeat): pretraining with checkpoints, the optimized preset with
workers, validation and KEEP_BEST, a run killed (SIGKILL inside a step) and continued with
RESUME=1, an out-of-memory recovery (a forward hook raises torch.OutOfMemoryError for micro-batches
over 4: the one thing a CPU cannot do), AUTO_BATCH=1 from a saved find-batch answer, SFT with
LENGTH_GROUPING, SFT with TOKEN_BUDGET and accumulation, and SFT with EFFECTIVE_BATCH and
LR_SCALING.

Floats compare to 1e-6 relative. Figures that depend on the clock or on the machine's free memory
(timings, throughput, data wait, elapsed time, RSS, MFU, pids) are compared for presence only, and
numbers inside decision reasons that quote free memory are masked. The trees' own paths are
replaced by placeholders. It takes a few minutes on 2 cores; it is not part of the test suite.
Exit code 0: no difference outside --expect-diff.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

SCENARIOS = ("base", "optimized", "killed", "oom", "auto_batch", "sft_grouping", "sft_budget", "sft_effective")
VOLATILE = re.compile(
    r"(_s$|time|per_sec|elapsed|pid|wait|compute_frac|rss|host_memory|gpu_monitor|ram_|written|input_bound|mfu"
    r"|tflops|peak_vram|vram_total)"
)
MEMORY_WORDS = re.compile(r"MB|RAM|swap")
TOL = 1e-6
WORDS = (
    "the quick brown fox jumps over a lazy dog while seven wise kings of old sang songs about "
    "rivers mountains bread wine summer winter light darkness and every small thing under heaven"
).split()
TINY = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 2, "n_positions": 64, "vocab_size": 512}


# ---- the shared inputs -------------------------------------------------------------------


def make_inputs(folder: Path) -> None:
    """A text corpus, a tiny model config and alpaca-style SFT pairs of varied length."""
    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14))).capitalize() + "." for _ in range(4000)]
    (folder / "corpus.txt").write_text("\n".join(lines) + "\n")
    (folder / "tiny.json").write_text(json.dumps(TINY))
    with open(folder / "sft.jsonl", "w") as f:
        for i in range(400):
            words = [rng.choice(WORDS) for _ in range(rng.randint(2, 30))]
            f.write(json.dumps({"instruction": f"Say {i} things", "input": "", "output": " ".join(words)}) + "\n")


def flags(inputs: Path, out: Path, cache: Path, name: str) -> list[str]:
    return [
        "--model_config", str(inputs / "tiny.json"), "--data_path", str(inputs / "corpus.txt"),
        "--vocab_size", "512", "--cache_dir", str(cache), "--output_dir", str(out / "runs"),
        "--max_length", "64", "--log_every", "1", "--seed", "5", "--run_name", name,
    ]  # fmt: skip


def sft_flags(inputs: Path, out: Path, cache: Path, name: str) -> list[str]:
    return [
        "--model_path", str(out / "runs" / "base" / "final"), "--data_path", str(inputs / "sft.jsonl"),
        "--cache_dir", str(cache), "--output_dir", str(out / "runs"), "--max_length", "64",
        "--log_every", "1", "--seed", "5", "--num_workers", "0", "--run_name", name,
    ]  # fmt: skip


def commands(scenario: str, inputs: Path, out: Path, cache: Path) -> list[tuple[list[str], dict]]:
    """(argv, options) for each process of a scenario; options: kill_at, oom_limit, auto_batch."""
    f = flags(inputs, out, cache, scenario)
    s = sft_flags(inputs, out, cache, scenario)
    if scenario == "base":
        return [(["pretrain", "--preset", "baseline", *f, "--batch_size", "4", "--max_steps", "6", "--save_every", "2"], {})]
    if scenario == "optimized":
        return [([
            "pretrain", "--preset", "optimized", *f, "--batch_size", "4", "--gradient_accumulation_steps", "2",
            "--num_workers", "2", "--max_steps", "6", "--save_every", "3", "--eval_every", "2",
            "--eval_batches", "2", "--keep_best", "1",
        ], {})]  # fmt: skip
    if scenario == "killed":
        argv = ["pretrain", "--preset", "baseline", *f, "--batch_size", "4", "--max_steps", "8", "--save_every", "2"]
        # SIGKILL in the 6th training forward: step-4 is saved, step 5's row is written and trimmed
        return [(argv, {"kill_at": 6}), ([*argv, "--resume", "1"], {})]
    if scenario == "oom":
        argv = ["pretrain", "--preset", "baseline", *f, "--batch_size", "8", "--gradient_accumulation_steps", "2",
                "--max_steps", "3"]  # fmt: skip
        return [(argv, {"oom_limit": 4})]
    if scenario == "auto_batch":
        base = ["--preset", "baseline", *f, "--batch_size", "8", "--gradient_accumulation_steps", "1"]
        return [(["find-batch", *base], {"auto_batch": (2, 4)}), (["pretrain", *base, "--max_steps", "3", "--auto_batch", "1"], {})]
    if scenario == "sft_grouping":
        return [(["sft", "--preset", "sft", *s, "--batch_size", "4", "--length_grouping", "1", "--max_steps", "4"], {})]
    if scenario == "sft_budget":
        return [([
            "sft", "--preset", "sft", *s, "--token_budget", "160", "--gradient_accumulation_steps", "2",
            "--max_steps", "4", "--save_every", "2",
        ], {})]  # fmt: skip
    if scenario == "sft_effective":
        return [([
            "sft", "--preset", "sft", *s, "--batch_size", "2", "--effective_batch", "16", "--lr_scaling", "linear",
            "--max_steps", "2",
        ], {})]  # fmt: skip
    raise SystemExit(f"error: unknown scenario {scenario!r}")


# ---- one process of a scenario (runs inside the tree) --------------------------------------


def child(argv: list[str], options: dict) -> int:
    """Run `python -m train ARGV` in this process, with the fakes the options ask for."""
    import torch

    torch.set_num_threads(1)
    try:  # where the tree builds every new model (train/models/build.py; train/core/model.py before)
        import train.models.build as model_lib
    except ImportError:
        import train.core.model as model_lib

    real = model_lib.build_model
    forwards = []

    def hook(module, args, kwargs):
        if not module.training:
            return
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        forwards.append(ids.shape[0])
        if options.get("kill_at") == len(forwards):
            os.kill(os.getpid(), signal.SIGKILL)
        if options.get("oom_limit") is not None and ids.shape[0] > options["oom_limit"] and len(forwards) >= 2:
            raise torch.OutOfMemoryError(f"CUDA out of memory. (fake: micro-batch {ids.shape[0]})")

    def build_model(*args, **kwargs):
        model = real(*args, **kwargs)
        getattr(model, "base_model", model).register_forward_pre_hook(hook, with_kwargs=True)
        return model

    if options.get("kill_at") or options.get("oom_limit") is not None:
        model_lib.build_model = build_model
    from train.__main__ import run

    sys.argv = ["train", *argv]
    return run()


def set_saved_batch(out: Path, size: int, accum: int) -> None:
    """find-batch's choice depends on timing: keep its key, fix the answer for both trees."""
    path = out / "runs" / ".auto_batch.json"
    saved = json.loads(path.read_text())
    saved.update(batch_size=size, gradient_accumulation_steps=accum)
    path.write_text(json.dumps(saved))


def run_tree(tree: Path, out: Path, inputs: Path, scenarios: list[str]) -> dict:
    """Every scenario in `tree`; returns {scenario: [exit codes]}."""
    cache = out / "cache"
    codes = {}
    for scenario in scenarios:
        codes[scenario] = []
        for argv, options in commands(scenario, inputs, out, cache):
            spec = json.dumps({"argv": argv, "options": {k: v for k, v in options.items() if k != "auto_batch"}})
            proc = subprocess.run(
                [sys.executable, str(Path(__file__).resolve()), "--child", spec],
                cwd=tree, env={**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"},
                capture_output=True, text=True,
            )  # fmt: skip
            codes[scenario].append(proc.returncode)
            (out / "logs").mkdir(parents=True, exist_ok=True)
            (out / "logs" / f"{scenario}.{len(codes[scenario])}.log").write_text(proc.stdout + proc.stderr)
            if "auto_batch" in options and proc.returncode == 0:
                set_saved_batch(out, *options["auto_batch"])
    return codes


# ---- the comparison ----------------------------------------------------------------------


def normalize(value, places: dict):
    if isinstance(value, str):
        for path, name in places.items():
            value = value.replace(path, name)
        return value
    if isinstance(value, dict):
        return {k: normalize(v, places) for k, v in value.items()}
    if isinstance(value, list):
        return [normalize(v, places) for v in value]
    return value


def differences(a, b, where: str, key: str = "") -> list[str]:
    if key and VOLATILE.search(key):
        return [] if (a is None) == (b is None) else [f"{where}: present in one only ({a!r} vs {b!r})"]
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{where}.{k}: only in {'base' if k in a else 'new'}" for k in sorted(set(a) ^ set(b))]
        for k in sorted(set(a) & set(b)):
            out += differences(a[k], b[k], f"{where}.{k}", k)
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{where}: {len(a)} items vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differences(x, y, f"{where}[{i}]", key)]
    if isinstance(a, float) and isinstance(b, (int, float)) and not isinstance(b, bool):
        same = (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=TOL, abs_tol=1e-12)
        return [] if same else [f"{where}: {a!r} vs {b!r}"]
    if isinstance(a, str) and isinstance(b, str) and MEMORY_WORDS.search(a):
        a, b = (re.sub(r"\d[\d,.]*", "#", s) for s in (a, b))
    return [] if a == b else [f"{where}: {a!r} vs {b!r}"]


def read_run(run: Path, places: dict) -> dict:
    record = {}
    for name in ("config.json", "summary.json"):
        path = run / name
        record[name] = normalize(json.loads(path.read_text()), places) if path.exists() else None
    metrics = run / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else None
    record["metrics.jsonl"] = normalize(rows, places)
    return record


def compare(base: Path, new: Path, scenarios: list[str], codes: dict) -> dict[str, list[str]]:
    found = {}
    for scenario in scenarios:
        diffs = []
        if codes["base"][scenario] != codes["new"][scenario]:
            diffs.append(f"exit codes {codes['base'][scenario]} vs {codes['new'][scenario]}")
        runs = [read_run(root / "runs" / scenario, {str(root): "<OUT>"}) for root in (base, new)]
        for name in runs[0]:
            diffs += differences(runs[0][name], runs[1][name], f"{scenario}/{name}")
        found[scenario] = diffs
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trees", nargs="*", help="BASE_TREE NEW_TREE: two checkouts (git worktree add ...)")
    p.add_argument("--work", help="where the runs go (default: a temporary folder, removed)")
    p.add_argument("--only", help="comma-separated scenarios (default: all): " + ",".join(SCENARIOS))
    p.add_argument("--expect-diff", default="", help="scenarios whose differences are intended (listed, not failed)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        return child(spec["argv"], spec["options"])
    if len(args.trees) != 2:
        p.error("give two trees: BASE_TREE NEW_TREE")
    scenarios = args.only.split(",") if args.only else list(SCENARIOS)
    if any(s.startswith("sft") for s in scenarios) and "base" not in scenarios:
        scenarios.insert(0, "base")  # SFT fine-tunes the base run's final/
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="golden-"))
    try:
        make_inputs(work / "inputs")
        codes = {}
        for label, tree in zip(("base", "new"), args.trees, strict=True):
            shutil.rmtree(work / label, ignore_errors=True)
            codes[label] = run_tree(Path(tree).resolve(), work / label, work / "inputs", scenarios)
            print(f"{label}: {tree}: exit codes {codes[label]}", flush=True)
        found = compare(work / "base", work / "new", scenarios, codes)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    expected = set(filter(None, args.expect_diff.split(",")))
    failed = 0
    for scenario, diffs in found.items():
        tag = " (expected)" if scenario in expected else ""
        print(f"{scenario}: {len(diffs)} difference(s){tag}")
        for line in diffs[:40]:
            print(f"  {line}")
        failed += 0 if tag else len(diffs)
    print(f"total: {failed} unexpected difference(s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
