"""Golden comparison of two source trees: the same seeded tiny CPU runs in each, compared key by key.

    .venv/bin/python bench/golden_compare.py BASE_TREE NEW_TREE [--work DIR] [--only a,b] [--expect-diff a,b]

A refactor that keeps behaviour leaves config.json, summary.json and every metrics.jsonl row the
same. Each scenario runs in its own process with the tree's `train` package first on sys.path and
one thread (so the numbers repeat): pretraining with checkpoints, the optimized preset with
workers, validation and KEEP_BEST, a run killed (SIGKILL inside a step) and continued with
RESUME=1, an out-of-memory recovery (a forward hook raises torch.OutOfMemoryError for micro-batches
over 4: the one thing a CPU cannot do), AUTO_BATCH=1 from a saved find-batch answer, SFT with
LENGTH_GROUPING, SFT with TOKEN_BUDGET and accumulation, SFT with EFFECTIVE_BATCH and LR_SCALING,
SFT with PACKING=1 and with LORA_R, T5 pretraining (span corruption) and T5 SFT, qwen3 pretraining
and SFT, and DPO (the default layout with REFERENCE=precomputed and =copy, PACKING=1, PACKING=0
with IPO, LORA_R with the adapters as the reference). Each scenario is driven through the command
line alone, so any checkout of the kit can be either tree.

Besides the three files, the saved tensors of final/ and of every checkpoints/step-*/ are compared
tensor by tensor (model.safetensors, adapters, state.pt's optimizer and RNG states): the largest
absolute difference of each against 1e-6 of the tensor's largest value, integers exactly; the
other files of those folders as JSON (timestamps and file hashes aside) or byte for byte.

Floats compare to 1e-6 relative; figures that depend on the clock or on the machine's free memory
are compared for presence only (bench/golden_diff.py says which). Both trees run in one folder (moved
aside after each), so their runs record the same paths; the trees' own paths become placeholders.
It takes tens of minutes on 2 loaded cores; it is not part of the test suite.
Exit code 0: no difference outside --expect-diff.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from golden_diff import differences, read_run, saved_differences

SCENARIOS = (
    "base", "optimized", "killed", "oom", "auto_batch", "sft_grouping", "sft_budget", "sft_effective",
    "sft_packing", "sft_lora", "t5_pretrain", "t5_sft", "qwen3_pretrain", "qwen3_sft",
    "dpo_precomputed", "dpo_copy", "dpo_rows", "dpo_padded_ipo", "dpo_lora",
)  # fmt: skip
# what a scenario starts from: the runs it fine-tunes (run first, in the same tree)
NEEDS = {"sft": ("base",), "t5_sft": ("t5_pretrain",), "qwen3_sft": ("qwen3_pretrain",),
         "dpo": ("base", "sft_grouping")}  # fmt: skip
WORDS = (
    "the quick brown fox jumps over a lazy dog while seven wise kings of old sang songs about "
    "rivers mountains bread wine summer winter light darkness and every small thing under heaven"
).split()
TINY = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 2, "n_positions": 64, "vocab_size": 512}
TINY_T5 = {
    "model_type": "t5", "d_model": 32, "d_ff": 64, "num_layers": 2, "num_decoder_layers": 2, "num_heads": 2,
    "d_kv": 16, "dropout_rate": 0.0, "feed_forward_proj": "relu", "tie_word_embeddings": True,
}  # fmt: skip
TINY_QWEN3 = {
    "model_type": "qwen3", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 2,
    "num_key_value_heads": 1, "head_dim": 32, "intermediate_size": 128, "max_position_embeddings": 64,
    "vocab_size": 512, "tie_word_embeddings": True, "attention_dropout": 0.0,
}  # fmt: skip


# ---- the shared inputs -------------------------------------------------------------------


def make_inputs(folder: Path) -> None:
    """A text corpus, a tiny model config and alpaca-style SFT pairs of varied length."""
    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    lines = [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14))).capitalize() + "." for _ in range(4000)
    ]
    (folder / "corpus.txt").write_text("\n".join(lines) + "\n")
    (folder / "tiny.json").write_text(json.dumps(TINY))
    (folder / "t5.json").write_text(json.dumps(TINY_T5))
    (folder / "qwen3.json").write_text(json.dumps(TINY_QWEN3))
    with open(folder / "sft.jsonl", "w") as f:
        for i in range(400):
            words = [rng.choice(WORDS) for _ in range(rng.randint(2, 30))]
            f.write(
                json.dumps({"instruction": f"Say {i} things", "input": "", "output": " ".join(words)}) + "\n"
            )
    with open(folder / "pairs.jsonl", "w") as f:  # preference pairs: a short right answer, a longer wrong one
        for i in range(64):
            pair = {"prompt": f"Say {i} twice.", "chosen": f"{i} {i}."}
            pair["rejected"] = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 16)))
            f.write(json.dumps(pair) + "\n")


def flags(inputs: Path, out: Path, cache: Path, name: str) -> list[str]:
    return [
        "--model_config", str(inputs / "tiny.json"), "--data_path", str(inputs / "corpus.txt"),
        "--vocab_size", "512", "--cache_dir", str(cache), "--output_dir", str(out / "runs"),
        "--max_length", "64", "--log_every", "1", "--seed", "5", "--run_name", name,
    ]  # fmt: skip


def sft_flags(inputs: Path, out: Path, cache: Path, name: str, start="base", data="sft.jsonl") -> list[str]:
    """Fine-tuning flags: the model is `start`'s final/ (a run of the same tree), the data inputs/`data`."""
    return [
        "--model_path", str(out / "runs" / start / "final"), "--data_path", str(inputs / data),
        "--cache_dir", str(cache), "--output_dir", str(out / "runs"), "--max_length", "64",
        "--log_every", "1", "--seed", "5", "--num_workers", "0", "--run_name", name,
    ]  # fmt: skip


def commands(scenario: str, inputs: Path, out: Path, cache: Path) -> list[tuple[list[str], dict]]:
    """(argv, options) for each process of a scenario; options: kill_at, oom_limit, auto_batch."""
    f = flags(inputs, out, cache, scenario)
    s = sft_flags(inputs, out, cache, scenario)
    if scenario == "base":
        return [
            (
                [
                    "pretrain",
                    "--preset",
                    "baseline",
                    *f,
                    "--batch_size",
                    "4",
                    "--max_steps",
                    "6",
                    "--save_every",
                    "2",
                ],
                {},
            )
        ]
    if scenario == "optimized":
        return [
            (
                [
                    "pretrain",
                    "--preset",
                    "optimized",
                    *f,
                    "--batch_size",
                    "4",
                    "--gradient_accumulation_steps",
                    "2",
                    "--num_workers",
                    "2",
                    "--max_steps",
                    "6",
                    "--save_every",
                    "3",
                    "--eval_every",
                    "2",
                    "--eval_batches",
                    "2",
                    "--keep_best",
                    "1",
                ],
                {},
            )
        ]
    if scenario == "killed":
        argv = [
            "pretrain",
            "--preset",
            "baseline",
            *f,
            "--batch_size",
            "4",
            "--max_steps",
            "8",
            "--save_every",
            "2",
        ]
        # SIGKILL in the 6th training forward: step-4 is saved, step 5's row is written and trimmed
        return [(argv, {"kill_at": 6}), ([*argv, "--resume", "1"], {})]
    if scenario == "oom":
        argv = [
            "pretrain",
            "--preset",
            "baseline",
            *f,
            "--batch_size",
            "8",
            "--gradient_accumulation_steps",
            "2",
            "--max_steps",
            "3",
        ]
        return [(argv, {"oom_limit": 4})]
    if scenario == "auto_batch":
        base = ["--preset", "baseline", *f, "--batch_size", "8", "--gradient_accumulation_steps", "1"]
        return [
            (["find-batch", *base], {"auto_batch": (2, 4)}),
            (["pretrain", *base, "--max_steps", "3", "--auto_batch", "1"], {}),
        ]
    if scenario == "sft_grouping":
        return [
            (
                [
                    "sft",
                    "--preset",
                    "sft",
                    *s,
                    "--batch_size",
                    "4",
                    "--length_grouping",
                    "1",
                    "--max_steps",
                    "4",
                ],
                {},
            )
        ]
    if scenario == "sft_budget":
        return [([
            "sft", "--preset", "sft", *s, "--token_budget", "160", "--gradient_accumulation_steps", "2",
            "--max_steps", "4", "--save_every", "2",
        ], {})]  # fmt: skip
    if scenario == "sft_effective":
        return [
            (
                [
                    "sft",
                    "--preset",
                    "sft",
                    *s,
                    "--batch_size",
                    "2",
                    "--effective_batch",
                    "16",
                    "--lr_scaling",
                    "linear",
                    "--max_steps",
                    "2",
                ],
                {},
            )
        ]
    if scenario == "sft_packing":
        return [(["sft", "--preset", "sft", *s, "--batch_size", "2", "--packing", "1", "--max_steps", "4",
                  "--save_every", "2", "--eval_every", "2", "--eval_batches", "2"], {})]  # fmt: skip
    if scenario == "sft_lora":
        return [(["sft", "--preset", "sft", *s, "--batch_size", "4", "--lora_r", "4", "--lora_dropout", "0",
                  "--learning_rate", "1e-2", "--max_steps", "4", "--save_every", "2"], {})]  # fmt: skip
    if scenario in ("t5_pretrain", "qwen3_pretrain"):
        model = "t5.json" if scenario == "t5_pretrain" else "qwen3.json"
        return [([
            "pretrain", "--preset", "baseline", *f, "--model_config", str(inputs / model),
            "--max_length", "32", "--batch_size", "4", "--gradient_accumulation_steps", "2",
            "--max_steps", "4", "--save_every", "2", "--eval_every", "2", "--eval_batches", "2",
        ], {})]  # fmt: skip
    if scenario in ("t5_sft", "qwen3_sft"):
        s = sft_flags(inputs, out, cache, scenario, scenario.replace("_sft", "_pretrain"))
        argv = ["sft", "--preset", "sft", *s, "--batch_size", "4", "--max_steps", "4", "--save_every", "2"]
        return [(argv, {})]
    if scenario.startswith("dpo_"):
        d = sft_flags(inputs, out, cache, scenario, "sft_grouping", "pairs.jsonl")
        more = {
            "dpo_precomputed": ["--reference", "precomputed", "--eval_every", "2", "--eval_batches", "2"],
            "dpo_copy": ["--reference", "copy", "--gradient_accumulation_steps", "2"],
            "dpo_rows": ["--reference", "copy", "--packing", "1", "--batch_size", "2"],
            "dpo_padded_ipo": ["--reference", "precomputed", "--packing", "0", "--dpo_loss", "ipo"],
            "dpo_lora": ["--lora_r", "4", "--lora_dropout", "0", "--learning_rate", "1e-2"],
        }[scenario]
        # LEARNING_RATE 1e-3, not the preset's 5e-6: the losses move off ln 2 by more than the tolerance
        return [(["dpo", "--preset", "dpo", *d, "--batch_size", "4", "--max_steps", "4", "--save_every", "2",
                  "--learning_rate", "1e-3", *more], {})]  # fmt: skip
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
        if (
            options.get("oom_limit") is not None
            and ids.shape[0] > options["oom_limit"]
            and len(forwards) >= 2
        ):
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
    # one thread; one hash seed, so that sets come out in one order (peft writes LORA_TARGETS' set as a list)
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    for scenario in scenarios:
        codes[scenario] = []
        for argv, options in commands(scenario, inputs, out, cache):
            spec = json.dumps(
                {"argv": argv, "options": {k: v for k, v in options.items() if k != "auto_batch"}}
            )
            proc = subprocess.run(
                [sys.executable, str(Path(__file__).resolve()), "--child", spec],
                cwd=tree, env=env, capture_output=True, text=True,
            )  # fmt: skip
            codes[scenario].append(proc.returncode)
            (out / "logs").mkdir(parents=True, exist_ok=True)
            (out / "logs" / f"{scenario}.{len(codes[scenario])}.log").write_text(proc.stdout + proc.stderr)
            if "auto_batch" in options and proc.returncode == 0:
                set_saved_batch(out, *options["auto_batch"])
    return codes


# ---- the comparison ----------------------------------------------------------------------


def compare(base: Path, new: Path, scenarios: list[str], codes: dict, trees: list[str]) -> tuple[dict, dict]:
    """({scenario: differences}, {scenario: counts of the saved files and tensors compared})."""
    found, counted = {}, {}
    for scenario in scenarios:
        diffs = []
        if codes["base"][scenario] != codes["new"][scenario]:
            diffs.append(f"exit codes {codes['base'][scenario]} vs {codes['new'][scenario]}")
        places = tuple({str(Path(tree).resolve()): "<TREE>"} for tree in trees)
        runs = [read_run(root / "runs" / scenario, place)
                for root, place in zip((base, new), places, strict=True)]
        for name in runs[0]:
            diffs += differences(runs[0][name], runs[1][name], f"{scenario}/{name}")
        counts = counted[scenario] = {"files": 0, "tensors": 0, "bitwise": 0}
        pair = (base / "runs" / scenario, new / "runs" / scenario)
        diffs += saved_differences(pair, scenario, places, counts)
        found[scenario] = diffs
    return found, counted


def with_needs(chosen: list[str]) -> list[str]:
    """The scenarios and the runs they fine-tune, in SCENARIOS' order."""
    wanted = set(chosen)
    for scenario in chosen:
        for prefix, needs in NEEDS.items():
            if scenario == prefix or scenario.startswith(prefix + "_"):
                wanted.update(needs)
    unknown = wanted - set(SCENARIOS)
    if unknown:
        known = ", ".join(SCENARIOS)
        raise SystemExit(f"error: unknown scenario(s) {', '.join(sorted(unknown))} (known: {known})")
    return [s for s in SCENARIOS if s in wanted]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("trees", nargs="*", help="BASE_TREE NEW_TREE: two checkouts, each of one commit (git "
                                            "worktree "
                   "add, or git archive COMMIT | tar -x -C DIR): one merged into mid-run mixes two versions")
    p.add_argument("--work", help="where the runs go (default: a temporary folder, removed)")
    p.add_argument("--only", help="comma-separated scenarios (default: all): " + ",".join(SCENARIOS))
    p.add_argument("--expect-diff", default="", help="scenarios whose differences are intended (listed, not "
                                                     "failed)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        return child(spec["argv"], spec["options"])
    if len(args.trees) != 2:
        p.error("give two trees: BASE_TREE NEW_TREE")
    scenarios = with_needs(args.only.split(",")) if args.only else list(SCENARIOS)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="golden-"))
    try:
        make_inputs(work / "inputs")
        codes = {}
        for label, tree in zip(("base", "new"), args.trees, strict=True):
            for folder in (work / label, work / "runs-here"):
                shutil.rmtree(folder, ignore_errors=True)
            # both trees write at the same path, so what a run records of its paths (and hashes of them,
            # as config.json's asked_sha256) is the same in both
            codes[label] = run_tree(Path(tree).resolve(), work / "runs-here", work / "inputs", scenarios)
            (work / "runs-here").rename(work / label)
            print(f"{label}: {tree}: exit codes {codes[label]}", flush=True)
        found, counted = compare(work / "base", work / "new", scenarios, codes, args.trees)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    expected = set(filter(None, args.expect_diff.split(",")))
    failed = 0
    for scenario, diffs in found.items():
        tag = " (expected)" if scenario in expected else ""
        c = counted[scenario]
        saved = f"; saved: {c['files']} files, {c['tensors']} tensors ({c['bitwise']} bitwise equal)"
        print(f"{scenario}: {len(diffs)} difference(s){tag}{saved}")
        for line in diffs[:40]:
            print(f"  {line}")
        failed += 0 if tag else len(diffs)
    print(f"total: {failed} unexpected difference(s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
