"""LoRA's memory saving on a 100M+ model: full fine-tuning against LORA_R=16, the kit's own SFT run.

Builds a GPT-2 small-size model (MODEL_SIZE=small's config at GPT-2's 50,304-row vocabulary,
124M parameters, random weights) as a MODEL_PATH folder with a byte-level BPE, then for each
setting runs the kit's dry run (DRY_RUN=1: its peak-memory estimate) and, with --steps N, a real
run of N optimizer steps under /usr/bin/time -v (the process's peak RSS).

    .venv/bin/python bench/lora_memory.py --steps 2 --batch_size 4 --max_length 128
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def make_folder(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from train.models.build import build_config, build_model

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    text = [p.read_text(errors="ignore") for p in sorted(Path(json.__file__).parent.glob("*.py"))]
    bpe.train_from_iterator(text, trainers.BpeTrainer(vocab_size=2048, special_tokens=["<|endoftext|>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
    cfg = build_config("small", None, 50304, tok.eos_token_id)
    build_model(cfg, gradient_checkpointing=False, seed=0).save_pretrained(folder)
    tok.save_pretrained(folder)


def run(folder: Path, out: Path, name: str, extra: list[str], args, dry: bool) -> dict:
    data = out / "pairs.jsonl"
    if not data.exists():
        data.write_text(
            "".join(
                json.dumps({"prompt": f"Explain item {i}.", "response": "It is a thing. " * 20}) + "\n"
                for i in range(64)
            )
        )
    argv = [
        sys.executable,
        "-m",
        "train",
        "sft",
        "--model_path",
        str(folder),
        "--data_path",
        str(data),
        "--output_dir",
        str(out / "runs"),
        "--cache_dir",
        str(out / "cache"),
        "--batch_size",
        str(args.batch_size),
        "--max_length",
        str(args.max_length),
        "--max_steps",
        str(max(1, args.steps)),
        "--num_workers",
        "0",
        "--save_every",
        "0",
        "--eval_batches",
        "1",
        "--run_name",
        name,
        *extra,
    ]
    if dry:
        text = subprocess.run(
            [*argv, "--dry_run"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout
        found = re.search(r"estimated peak ([\d,.]+) MB", text)
        keep = ("  weights", "  activations", "  estimated", "model ")
        return {
            "estimate_mb": found and found.group(1),
            "estimate": [ln for ln in text.splitlines() if ln.startswith(keep)],
        }
    done = subprocess.run(
        ["/usr/bin/time", "-v", *argv], cwd=ROOT, capture_output=True, text=True, check=True
    )
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr).group(1))
    summary = json.loads((out / "runs" / name / "summary.json").read_text())
    return {
        "peak_rss_mb": rss // 1024,
        "wall_time_s": summary["wall_time_s"],
        "final_loss": summary["final_loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=0, help="real optimizer steps per setting (0: the "
                                                             "estimate only)")
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--max_length", type=int, default=128)
    parser.add_argument("--lora_r", type=int, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        make_folder(out / "model")
        for name, extra in (("full", []), ("lora", ["--lora_r", str(args.lora_r)])):
            row = run(out / "model", out, name, extra, args, dry=True)
            if args.steps:
                row.update(run(out / "model", out, name, extra, args, dry=False))
            print(name, json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
