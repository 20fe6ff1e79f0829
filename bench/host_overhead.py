"""Host overhead per optimizer step: the real loop (`python -m train pretrain|sft`, the launchers'
code: loader, collators, step, meter, logging) with the compute made negligible, so that what is
left of a step is the host's own work, the part a GPU would sit idle through.

The model is one layer of width 8 (GPT-2, or T5 with one encoder and one decoder layer) at the real vocabulary
(the kit's byte-level BPE, 8192) and the real batch shapes of the launchers: pretraining batch 8 x 256 tokens;
SFT batch 16 x accumulation 2 at MAX_LENGTH 512 (plain, LENGTH_GROUPING=1, PACKING=1, TOKEN_BUDGET=4096); T5
span corruption 8 x 256 and T5 SFT 16 x 2. The LM head's (tokens x vocab) matmul is the math that remains (a
few ms here); data-wait (summary.json's data_wait_frac) is the share of the step spent in the loader and
collator. One thread, each path in its own process; figures are the median of the runs' steady-state
step_time_ms (warm-up excluded, LOG_EVERY=10 as a user would log).

    .venv/bin/python bench/host_overhead.py                    # every path, 3 runs each
    .venv/bin/python bench/host_overhead.py --paths sft_packed --profile /tmp/prof   # + cProfile
    .venv/bin/python bench/host_overhead.py --before /tmp/older-checkout  # + an older tree, alternated

Everything is made offline in --work (default /tmp/kit-host-overhead; the tokenizer and the token
caches are kept between invocations, so a second one starts at once).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data_sft import alpaca_rows  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GPT2 = {"model_type": "gpt2", "n_layer": 1, "n_embd": 8, "n_head": 1, "n_positions": 1024}
T5 = {"model_type": "t5", "d_model": 8, "d_ff": 16, "num_layers": 1, "num_decoder_layers": 1, "num_heads": 1,
      "d_kv": 8, "dropout_rate": 0.0, "feed_forward_proj": "relu", "tie_word_embeddings": True}  # fmt: skip
PRETRAIN = ["--batch_size", "8", "--max_length", "256", "--vocab_size", "8192"]
SFT = ["--batch_size", "16", "--gradient_accumulation_steps", "2", "--max_length", "512"]
PATHS = {
    "pretrain": ("pretrain", "gpt2", PRETRAIN),
    "sft_plain": ("sft", "gpt2", SFT),
    "sft_grouped": ("sft", "gpt2", [*SFT, "--length_grouping", "1"]),
    "sft_packed": ("sft", "gpt2", [*SFT, "--packing", "1"]),
    "sft_token_budget": ("sft", "gpt2", [*SFT, "--token_budget", "4096"]),
    "t5_pretrain": ("pretrain", "t5", PRETRAIN),
    "t5_sft": ("sft", "t5", SFT),
}


def run(root: Path, args: list[str], profile: Path | None = None) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(root), PYTHONDONTWRITEBYTECODE="1")
    head = [sys.executable] + (["-m", "cProfile", "-o", str(profile)] if profile else []) + ["-m", "train"]
    proc = subprocess.run([*head, *args], cwd=root, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"error: python -m train {' '.join(args)} exited "
                         f"{proc.returncode}:\n{proc.stdout[-2000:]}"
                         f"{proc.stderr[-2000:]}")
    out = Path(args[args.index("--output_dir") + 1]) / args[args.index("--run_name") + 1]
    return json.loads((out / "summary.json").read_text())


def prepare(work: Path, root: Path) -> dict[str, Path]:
    """The text, the SFT rows and the two tiny base models (a 1-step pretraining run each)."""
    work.mkdir(parents=True, exist_ok=True)
    text, sft = work / "pretrain.txt", work / "sft.jsonl"
    if not text.exists():
        text.write_text("\n".join(r["instruction"] + " " + r["output"] for r in alpaca_rows(4000, seed=1)))
        sft.write_text("".join(json.dumps(r) + "\n" for r in alpaca_rows(4000, seed=2)))
    made = {"text": text, "sft": sft}
    for family, config in (("gpt2", GPT2), ("t5", T5)):
        folder = work / f"config-{family}"
        folder.mkdir(exist_ok=True)
        (folder / "config.json").write_text(json.dumps(config))
        made[f"config-{family}"] = folder
        final = work / "base" / family / "final"
        if not (final / "config.json").exists():
            run(
                root,
                [
                    "pretrain",
                    "--model_config",
                    str(folder),
                    "--data_path",
                    str(text),
                    *PRETRAIN,
                    "--max_steps",
                    "1",
                    "--cache_dir",
                    str(work / "cache"),
                    "--output_dir",
                    str(work / "base"),
                    "--run_name",
                    family,
                    "--overwrite",
                    "1",
                ],
            )
        made[f"base-{family}"] = final
    return made


def bench_path(name: str, made: dict, work: Path, root: Path, steps: int, profile: Path | None) -> dict:
    mode, family, flags = PATHS[name]
    model = (
        ["--model_config", str(made[f"config-{family}"]), "--data_path", str(made["text"])]
        if mode == "pretrain"
        else ["--model_path", str(made[f"base-{family}"]), "--data_path", str(made["sft"])]
    )
    return run(
        root,
        [
            mode,
            *model,
            *flags,
            "--max_steps",
            str(steps),
            "--log_every",
            "10",
            "--num_workers",
            "0",
            "--cache_dir",
            str(work / "cache"),
            "--output_dir",
            str(work / "runs"),
            "--run_name",
            name,
            "--overwrite",
            "1",
        ],
        profile,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--paths", default=",".join(PATHS), help="comma-separated: " + ", ".join(PATHS))
    parser.add_argument("--runs", type=int, default=3, help="runs per path (median reported)")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per run")
    parser.add_argument("--work", default="/tmp/kit-host-overhead")
    parser.add_argument("--root", default=str(ROOT), help="the kit tree to time (default: this one)")
    parser.add_argument("--before", default=None, help="another kit tree (an older commit) timed in "
                        "alternation with --root: one run of each in turn, so drifting load favours neither")
    parser.add_argument("--profile", default=None, help="folder: one cProfile run per path (<path>.prof)")
    args = parser.parse_args(argv)
    work, root = Path(args.work), Path(args.root)
    names = [n for n in args.paths.split(",") if n]
    unknown = [n for n in names if n not in PATHS]
    if unknown:
        print(f"error: --paths: unknown {', '.join(unknown)} (known: {', '.join(PATHS)})", file=sys.stderr)
        return 2
    trees = {"after": root, **({"before": Path(args.before)} if args.before else {})}
    made = {side: prepare(work / side, tree) for side, tree in trees.items()}
    print(
        f"{'path':18}"
        + "".join(f"{side + ' ms':>11}{'wait':>6}{'syncs':>6}" for side in trees)
        + "  runs (ms/step)"
    )
    for name in names:
        if args.profile:
            Path(args.profile).mkdir(parents=True, exist_ok=True)
            bench_path(
                name, made["after"], work / "after", root, args.steps, Path(args.profile) / f"{name}.prof"
            )
        summaries: dict[str, list] = {side: [] for side in trees}
        for _ in range(args.runs):
            for side, tree in trees.items():
                summaries[side].append(bench_path(name, made[side], work / side, tree, args.steps, None))
        line, runs = f"{name:18}", []
        for side, got in summaries.items():
            times = [s["step_time_ms"] for s in got]
            wait = statistics.median(s.get("data_wait_frac") or 0 for s in got)
            line += (
                f"{statistics.median(times):11.1f}{wait:6.0%}{got[-1].get('host_syncs_per_step', 'n/a')!s:>6}"
            )
            runs.append(side + " " + ", ".join(f"{t:.1f}" for t in times))
        print(line + "  " + "; ".join(runs), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
