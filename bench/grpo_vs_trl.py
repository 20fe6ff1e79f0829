"""The kit's GRPO step against TRL 1.16's GRPOTrainer: the same model folder (a kit SFT run's final/), the
same built-in arithmetic prompts rendered by the model's chat template (TRL gets the rendered text, which it
feeds as it is), NUM_GENERATIONS, MAX_COMPLETION_LENGTH, learning rate, loss (dapo, BETA 0) and reward
functions (the kit's accuracy and format), fp32 on the CPU for both (TRL's bf16 and gradient checkpointing
off). The sides run in alternation, kit then TRL, PAIRS times, each a process of its own (the kit: `python -m
train grpo`; TRL: bench/grpo_trl_side.py in a scratch venv). Per side: the median seconds per optimizer step
after the first SKIP steps, and the share of those steps spent making the completions (the kit's rollout,
generation_frac; TRL's _generate_and_score_completions, and _generate alone). Results: bench/RESULTS.md.

    .venv/bin/python bench/grpo_vs_trl.py --model runs/<an SFT run>/final [--steps 10 --batch 2 --g 8
        --length 16 --pairs 3 --trl-python /tmp/venv-trl/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

KIT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(KIT))
SKIP = 2  # steps left out of each side's figures: allocator warm-up, the first sampling's set-up


def write_prompts(model: Path, path: Path) -> None:
    """The built-in task's prompts as the kit renders them, with their answers (TRL's prompt-only records)."""
    from transformers import AutoTokenizer

    from train.data.prompt.arithmetic import arithmetic_prompts
    from train.data.prompt.prompts import render_prompt

    tok = AutoTokenizer.from_pretrained(model, local_files_only=True)
    records = [{"prompt": render_prompt(tok, p.turns), **p.columns} for p in arithmetic_prompts(1337)]
    path.write_text(json.dumps(records))


def threads(a) -> dict:
    """Both sides' environment: torch's intra-op threads pinned (on a shared host, threads that wait for each
    other's cores made one tiny side's step 0.2 s in one pair and 7.4 s in the next)."""
    return {**os.environ, "OMP_NUM_THREADS": str(a.threads), "MKL_NUM_THREADS": str(a.threads)}


def kit_side(a, out: Path, name: str) -> dict:
    argv = [
        sys.executable,
        "-m",
        "train",
        "grpo",
        "--model_path",
        str(a.model),
        "--max_steps",
        str(a.steps),
        "--batch_size",
        str(a.batch),
        "--num_generations",
        str(a.g),
        "--max_completion_length",
        str(a.length),
        "--learning_rate",
        str(a.lr),
        "--loss_type",
        "dapo",
        "--precision",
        "fp32",
        "--log_every",
        "1",
        "--output_dir",
        str(out),
        "--cache_dir",
        str(out / "cache"),
        "--run_name",
        name,
        "--overwrite",
        "1",
        "--num_workers",
        "0",
    ]
    proc = subprocess.run(argv, cwd=KIT, capture_output=True, text=True, env=threads(a))
    if proc.returncode:
        sys.exit(f"the kit's side failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    at = [0.0] + [r["elapsed_s"] for r in rows]
    steps = [b - a for a, b in zip(at, at[1:], strict=False)]
    gen = [r["generation_frac"] * s for r, s in zip(rows, steps, strict=True)]
    return {"step_s": statistics.median(steps[SKIP:]), "generation": sum(gen[SKIP:]) / sum(steps[SKIP:]),
            "length": statistics.mean(r["completions/mean_length"] for r in rows)}


def trl_side(a, prompts: Path) -> dict:
    argv = [a.trl_python, str(KIT / "bench" / "grpo_trl_side.py"), str(prompts), str(a.model), str(a.steps),
            str(a.batch), str(a.g), str(a.length), str(a.lr)]  # fmt: skip
    proc = subprocess.run(argv, cwd=KIT, capture_output=True, text=True,
                          env={**threads(a), "TOKENIZERS_PARALLELISM": "false"})  # fmt: skip
    if proc.returncode:
        sys.exit(f"TRL's side failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    at = [out["start"], *out["ends"]]
    steps = [b - a for a, b in zip(at, at[1:], strict=False)]
    kept = sum(steps[SKIP:])
    return {"step_s": statistics.median(steps[SKIP:]), "generation": sum(out["rollout_s"][SKIP:]) / kept,
            "sampling": sum(out["sampling_s"][SKIP:]) / kept, "length": out["mean_length"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=2, help="prompts per step")
    p.add_argument("--g", type=int, default=8, help="NUM_GENERATIONS")
    p.add_argument("--length", type=int, default=16, help="MAX_COMPLETION_LENGTH")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--trl-python", default="/tmp/venv-trl/bin/python")
    p.add_argument("--threads", type=int, default=1, help="torch's threads on each side (OMP_NUM_THREADS)")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        prompts = out / "prompts.json"
        write_prompts(a.model, prompts)
        pairs = []
        for i in range(a.pairs):
            kit, trl = kit_side(a, out, f"kit-{i}"), trl_side(a, prompts)
            pairs.append((kit, trl))
            print(f"pair {i + 1}: kit {kit['step_s']:.3f} s/step (generation {kit['generation']:.0%}, length "
                  f"{kit['length']:.1f}); TRL {trl['step_s']:.3f} s/step (generate+score "
                  f"{trl['generation']:.0%}, "
                  f"_generate {trl['sampling']:.0%}, length {trl['length']:.1f}); TRL / kit "
                  f"{trl['step_s'] / kit['step_s']:.2f}x", flush=True)  # fmt: skip
        ratios = [t["step_s"] / k["step_s"] for k, t in pairs]
        print(f"median TRL / kit per step: {statistics.median(ratios):.2f}x (pairs: "
              f"{', '.join(f'{r:.2f}' for r in ratios)})")


if __name__ == "__main__":
    main()
