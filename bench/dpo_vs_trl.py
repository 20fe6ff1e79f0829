"""Preference training against TRL's DPOTrainer: the same model, pairs, batch, length, beta and
learning rate, one thread each, CPU, runs alternated (kit, TRL, kit, TRL ...) so both see the same
machine, the median of the pairs' ratios printed. TRL runs in a scratch venv (never the kit's):

    python3 -m venv /tmp/trlvenv && /tmp/trlvenv/bin/pip install torch==2.13.0 transformers==5.23.0 trl==1.16.0
    .venv/bin/python bench/dpo_vs_trl.py --trl-python /tmp/trlvenv/bin/python [--model runs/x/final] [--repeat 3]

Without --model a nano GPT-2 is pretrained for 2 steps first (its weights do not matter for speed).
Both sides read the same prompt/chosen/rejected strings: TRL concatenates them as text, the kit with
TEMPLATE=none (its raw form: prompt + eos, then the reply + eos), REFERENCE=copy as TRL's default
(a frozen copy of the policy). Figures: steady pairs/s (each side leaves its first steps out).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

KIT = Path(__file__).resolve().parent.parent
WORDS = ("the quick brown fox jumps over a lazy dog while seven wise kings of old sang songs about rivers "
         "mountains bread wine summer winter light darkness and every small thing under heaven").split()


def write_pairs(path: Path, n: int = 512) -> None:
    rng = random.Random(0)

    def words(k):
        return " ".join(rng.choice(WORDS) for _ in range(k))

    with path.open("w") as f:
        for _ in range(n):  # replies start with a space: the prompt ends on a token boundary for TRL
            f.write(json.dumps({"prompt": "Say something about " + words(rng.randint(10, 30)),
                                "chosen": " " + words(rng.randint(15, 35)),
                                "rejected": " " + words(rng.randint(15, 35))}) + "\n")


def env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")


def kit_run(work: Path, model: str, pairs: Path, a, i: int) -> float:
    argv = [sys.executable, "-m", "train", "dpo", "--model_path", model, "--data_path", str(pairs),
            "--batch_size", str(a.batch), "--gradient_accumulation_steps", "1", "--max_length", str(a.max_length),
            "--max_steps", str(a.steps), "--beta", "0.1", "--learning_rate", "1e-5", "--lr_schedule", "constant",
            "--warmup_steps", "0", "--template", "none", "--reference", "copy", "--num_workers", "0",
            "--val_fraction", "0", "--output_dir", str(work / "runs"), "--run_name", f"kit{i}",
            "--cache_dir", str(work / "cache"), "--log_every", "1"]
    done = subprocess.run(argv, cwd=KIT, env=env(), capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"kit run failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return json.loads((work / "runs" / f"kit{i}" / "summary.json").read_text())["samples_per_sec"]


def trl_run(trl_python: str, model: str, pairs: Path, a, work: Path) -> float:
    argv = [trl_python, str(KIT / "bench" / "dpo_trl_side.py"), model, str(pairs), "--batch", str(a.batch),
            "--max_length", str(a.max_length), "--steps", str(a.steps), "--out", str(work / "trl")]
    done = subprocess.run(argv, env=env(), capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"TRL run failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["pairs_per_sec"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trl-python", required=True, help="a python with trl 1.16 (a scratch venv)")
    p.add_argument("--model", help="a causal-LM folder with its tokenizer (default: a nano GPT-2, 2 steps)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max_length", type=int, default=128)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dpo-vs-trl-"))
    pairs = work / "pairs.jsonl"
    write_pairs(pairs)
    model = a.model
    if model is None:
        subprocess.run([sys.executable, "-m", "train", "pretrain", "--model_size", "nano", "--max_steps", "2",
                        "--output_dir", str(work / "runs"), "--run_name", "base", "--cache_dir", str(work / "cache")],
                       cwd=KIT, env=env(), check=True, capture_output=True)
        model = str(work / "runs" / "base" / "final")
    rows = []
    for i in range(a.repeat):
        kit = kit_run(work, model, pairs, a, i)
        trl = trl_run(a.trl_python, model, pairs, a, work)
        rows.append((kit, trl))
        print(f"pair {i + 1}: kit {kit:.2f} pairs/s, TRL {trl:.2f} pairs/s, {kit / trl:.2f}x", flush=True)
    ratio = statistics.median(k / t for k, t in rows)
    print(f"median of {a.repeat} pairs: kit / TRL = {ratio:.2f}x (batch {a.batch} pairs, max_length {a.max_length}, "
          f"{a.steps} steps, 1 thread)")


if __name__ == "__main__":
    main()
