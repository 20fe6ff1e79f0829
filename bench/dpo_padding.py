"""DPO's padding efficiency, padded (PACKING=0) against the default (PACKING empty: each micro-batch packed),
on
the built-in pairs and on LLaMA-Factory-shaped pairs (prompts 20-600 tokens, replies 10-400, as dpo_en_demo).

A tiny GPT-2 (2 layers, width 64, context 1024) with a byte-level BPE trained on the text below is the
MODEL_PATH. For each data shape and PACKING it runs the kit's own `python -m train dpo` (BATCH_SIZE 8,
MAX_LENGTH 1024, REFERENCE=copy, one thread) and reads summary.json's padding_efficiency (real tokens / tokens
run, this CPU's form: no widths) and the step losses, which must agree between the two to 1e-5. Then the CUDA
form, counted on the host: the data front door made for a CUDA device (length buckets for the padded batches,
the flat row rounded up to 8 tokens for the packed ones) and every micro-batch of 8 of one seeded epoch
collated.

    .venv/bin/python bench/dpo_padding.py [--steps 4] [--text /path/to/some.txt]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHAKESPEARE = Path("/work/shared/data/tinyshakespeare.txt")


def corpus(path: str | None) -> str:
    if path:
        return Path(path).read_text(errors="ignore")
    if SHAKESPEARE.is_file():
        return SHAKESPEARE.read_text()
    return "".join(p.read_text(errors="ignore") for p in sorted(Path(json.__file__).parent.glob("*.py")))


def make_folder(folder: Path, text: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, PreTrainedTokenizerFast

    from train.models.build import build_model

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([text], trainers.BpeTrainer(vocab_size=1024, special_tokens=["<|endoftext|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=1024, vocab_size=1024, bos_token_id=0,
                     eos_token_id=0)  # fmt: skip
    build_model(cfg, gradient_checkpointing=False, seed=0).save_pretrained(folder)
    tok.save_pretrained(folder)
    return tok


def lf_pairs(path: Path, tok, text: str, n: int, seed: int = 0) -> None:
    """n pairs of token-length prompts 20-600 and replies 10-400: slices of the text's tokens, decoded."""
    ids = tok(text[:400_000])["input_ids"]
    rng = np.random.default_rng(seed)

    def piece(lo: int, hi: int) -> str:
        n_tokens = int(rng.integers(lo, hi + 1))
        at = int(rng.integers(0, len(ids) - n_tokens))
        return tok.decode(ids[at : at + n_tokens])

    rows = [
        {"instruction": piece(20, 600), "chosen": piece(10, 400), "rejected": piece(10, 400)}
        for _ in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def dpo_run(folder: Path, out: Path, name: str, data: Path | None, packing: str, steps: int) -> dict:
    argv = [
        sys.executable,
        "-m",
        "train",
        "dpo",
        "--model_path",
        str(folder),
        "--output_dir",
        str(out / "runs"),
        "--cache_dir",
        str(out / "cache"),
        "--max_length",
        "1024",
        "--batch_size",
        "8",
        "--max_steps",
        str(steps),
        "--reference",
        "copy",
        "--log_every",
        "1",
        "--num_workers",
        "0",
        "--val_fraction",
        "0",
        "--save_every",
        "0",
        "--packing",
        packing,
        "--run_name",
        name,
        "--overwrite",
        "1",
    ]
    if data is not None:
        argv += ["--data_path", str(data)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    run = out / "runs" / name
    summary = json.loads((run / "summary.json").read_text())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    lengths = next((ln for ln in done.stdout.splitlines() if "prompt lengths in tokens" in ln), "")
    return {"efficiency": summary["padding_efficiency"], "losses": [r["loss"] for r in rows if "loss" in r],
            "tokens_per_sec": summary["tokens_per_sec"], "lengths": lengths.strip()}


def cuda_form(folder: Path, out: Path, data: Path | None, packing: bool | None, batch: int = 8) -> float:
    """Padding efficiency of one seeded epoch of micro-batches as a CUDA run's collators make them (host
    only)."""
    import torch

    import config
    from train.data.preference import preference_data
    from train.data.tokenizer import chat_tokens, folder_tokenizer
    from train.models.family import CAUSAL_LM

    tok = folder_tokenizer(folder, "MODEL_PATH", False)  # as the run makes it (SFTSource.tokenizer)
    d = config.DataConfig(
        data_path=None if data is None else str(data),
        packing=packing,
        cache_dir=str(out / "cache"),
        val_fraction=0.0,
    )
    chat_tokens(tok, d.template)
    data_ = preference_data(
        d,
        tok,
        layout=CAUSAL_LM,
        max_length=1024,
        device=torch.device("cuda"),
        precision="bf16",
        eval_batches=20,
        set_attention=lambda kind: None,
        say=lambda *a: None,
        decide=lambda *a: None,
    )
    order = np.random.default_rng(0).permutation(len(data_.dataset))
    real = run = 0
    for k in range(0, len(order) - batch + 1, batch):
        b = data_.collate([data_.dataset[int(i)] for i in order[k : k + batch]])
        real, run = real + b["n_real_tokens"], run + b["n_padded_tokens"]
    return real / run


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=400, help="LLaMA-Factory-shaped pairs to make")
    parser.add_argument("--text", default=None, help="text the tokenizer and the LF-shaped pairs come from")
    args = parser.parse_args()
    text = corpus(args.text)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        tok = make_folder(out / "model", text)
        lf = out / "lf_pairs.jsonl"
        lf_pairs(lf, tok, text, args.pairs)
        print("| data | PACKING | padding efficiency (CPU run) | CUDA form | tokens/s (CPU) | step losses "
              "equal |")
        print("| --- | --- | --- | --- | --- | --- |")
        for shape, data in (("built-in pairs", None), ("LLaMA-Factory-shaped", lf)):
            runs = {p: dpo_run(out / "model", out, f"{shape[:5]}-{p or 'empty'}", data, p, args.steps)
                    for p in ("0", "")}  # fmt: skip
            gap = max(abs(a - b) for a, b in zip(runs["0"]["losses"], runs[""]["losses"], strict=True))
            for p, r in runs.items():
                form = cuda_form(out / "model", out, data, {"0": False, "": None}[p])
                same = f"max diff {gap:.1e}" if p == "" else ""
                print(f"| {shape} | {p or 'empty'} | {r['efficiency']:.3f} | {form:.3f} | "
                      f"{r['tokens_per_sec']:,.0f} "
                      f"| {same} |")
            print(f"<!-- {shape}: {runs['0']['lengths']} -->")


if __name__ == "__main__":
    main()
