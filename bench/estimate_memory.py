"""Peak-memory estimate (train/models/estimate.py, asked as a run asks it: estimate_for_run at the rows
the data gives, train/run/plan/fill.py row_shape) against the measured peak of real training steps of
every path, at two sizes each, through the kit's own optimizer, collators and train_step.

Measured: on CPU, the allocator's own events at the peak of the second step (live_bytes.allocated_peak: every
allocation, forward, backward and optimizer, temporaries inside kernels included); on a GPU,
torch.cuda.max_memory_allocated over the same two steps. The last column names the terms the estimate adds on
a GPU only, which a CPU row cannot check.

    .venv/bin/python bench/estimate_memory.py                 # every path, fp32 and bf16, on this device
    .venv/bin/python bench/estimate_memory.py --paths t5-pretrain sft-packed --precision bf16
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import config  # noqa: E402
from train.core.attention import VARLEN_SDPA, use_attention  # noqa: E402
from train.core.measure.live_bytes import allocated_peak, held_by  # noqa: E402
from train.core.model import count_params  # noqa: E402
from train.core.optim.registry import build_optimizer  # noqa: E402
from train.core.seq2seq import span_lengths  # noqa: E402
from train.core.step import train_step  # noqa: E402
from train.core.units import IGNORE_INDEX, MIB  # noqa: E402
from train.data.chat.batching import Seq2SeqCollator  # noqa: E402
from train.data.chat.conversation_cache import SFTDataset  # noqa: E402
from train.data.chat.packing import PackedCollator, PackedRows, pack  # noqa: E402
from train.distributed.parallel import build_scaler  # noqa: E402
from train.models.build import build_config, build_model  # noqa: E402
from train.models.estimate import estimate_for_run  # noqa: E402
from train.models.family import CAUSAL_LM, ENCODER_DECODER, family_of  # noqa: E402
from train.run.plan.adapt import row_shape  # noqa: E402

VOCAB = 2048
GPU_TERMS = {
    "gpt2-pretrain": "cuBLAS workspaces",
    "llama-pretrain": "cuBLAS workspaces",
    "t5-pretrain": "cuBLAS workspaces; biased attention on sdpa's math path, fp32 upcast (9 B/score)",
    "t5-sft": "cuBLAS workspaces; biased attention on sdpa's math path, fp32 upcast (9 B/score)",
    "sft-packed": "cuBLAS workspaces",
    "dpo-pairs": "cuBLAS workspaces",
}


def gpt2(width: int, dropout: float = 0.1):
    hf = build_config("nano", None, VOCAB, 0)
    hf.n_layer, hf.n_embd, hf.n_head, hf.n_positions = 2, width, width // 64, 1024
    hf.resid_pdrop = hf.embd_pdrop = hf.attn_pdrop = dropout
    return build_model(hf, False, 0)


def t5(width: int):
    hf = build_config("nano", None, VOCAB, 0, "t5")
    hf.d_model, hf.num_layers, hf.num_decoder_layers, hf.num_heads, hf.d_kv, hf.d_ff = (
        width,
        2,
        2,
        width // 64,
        64,
        4 * width,
    )
    return build_model(hf, False, 0)


def llama(width: int):
    from transformers import LlamaConfig

    hf = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=width,
        intermediate_size=int(2.75 * width),
        num_hidden_layers=2,
        num_attention_heads=width // 64,
        num_key_value_heads=max(1, width // 128),
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    return build_model(hf, False, 0)


def ids(*shape) -> torch.Tensor:
    return torch.randint(1, VOCAB, shape, generator=torch.Generator().manual_seed(0))


def conversations(n: int, longest: int, pairs: bool = False) -> list[dict]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        k = longest if i == 0 else int(rng.integers(8, longest))
        row = rng.integers(1, VOCAB, k).tolist()
        if pairs:
            out.append({"input_ids": row, "labels": rng.integers(1, VOCAB, max(4, k // 2)).tolist()})
        else:
            out.append({"input_ids": row, "labels": [IGNORE_INDEX] * (k // 3) + row[k // 3:]})
    return out


def path(name: str, size: int) -> dict:
    """The model, micro-batches and the settings the estimate is asked with, for one path at size 0 or 1."""
    if name in ("gpt2-pretrain", "llama-pretrain"):
        batch, length = ((8, 256), (8, 512))[size]
        model = (gpt2 if name == "gpt2-pretrain" else llama)((128, 256)[size])
        return {
            "model": model,
            "batches": [{"input_ids": ids(batch, length)}],
            "mode": "pretrain",
            "batch": batch,
            "max_length": length,
        }
    if name == "t5-pretrain":
        batch, length = ((8, 256), (8, 512))[size]
        return {"model": t5((128, 256)[size]), "mode": "pretrain", "batch": batch, "max_length": length,
                "batches": [{"input_ids": ids(batch, length), "labels": ids(batch, span_lengths(length)[1])}]}
    if name == "t5-sft":
        rows, longest = ((8, 128), (8, 256))[size]
        examples = conversations(rows, longest, pairs=True)
        collate = Seq2SeqCollator(0)
        return {
            "model": t5((128, 256)[size]),
            "mode": "sft",
            "batch": rows,
            "max_length": 512,
            "batches": [collate(examples)],
            "dataset": SFTDataset(examples, ENCODER_DECODER),
            "collate": collate,
        }
    if name == "sft-packed":
        n, length = ((32, 256), (64, 512))[size]
        examples = conversations(n, length * 3 // 4)
        dataset = PackedRows(examples, pack([len(e["input_ids"]) for e in examples], length).rows)
        model = gpt2((128, 256)[size])
        use_attention(model, VARLEN_SDPA)
        collate = PackedCollator(0, attention=VARLEN_SDPA)
        return {
            "model": model,
            "mode": "sft",
            "batch": len(dataset),
            "max_length": length,
            "packing": True,
            "batches": [collate([dataset[i] for i in range(len(dataset))])],
            "dataset": dataset,
            "collate": collate,
        }
    if name == "dpo-pairs":
        from train.data.chat.pair_batching import PairCollator

        pairs, length = ((4, 128), (4, 256))[size]
        rng = np.random.default_rng(0)
        data = []
        for _ in range(pairs):
            chosen, rejected = (rng.integers(1, VOCAB, length * 3 // 4).tolist() for _ in range(2))
            data.append({"prompt_ids": rng.integers(1, VOCAB, length // 4).tolist(), "chosen_ids": chosen,
                         "chosen_labels": chosen, "rejected_ids": rejected, "rejected_labels": rejected})
        return {"model": gpt2((128, 256)[size]), "mode": "dpo", "batch": pairs, "max_length": length,
                "reference": "copy", "batches": [PairCollator(0)(data)]}
    raise ValueError(name)


def measure(p: dict, precision: str, device: torch.device) -> float:
    """Peak bytes of the second of two train_steps (the first makes AdamW's state)."""
    model, objective = p["model"].to(device), None
    if p["mode"] == "dpo":  # DPO's sigmoid loss against a frozen copy (REFERENCE=copy) of the policy
        from train.core.preference.loss import PreferenceObjective
        from train.core.preference.reference import build_reference

        objective = PreferenceObjective(
            CAUSAL_LM, "sigmoid", reference=build_reference("copy", model, layout=CAUSAL_LM)
        )
    cfg = config.resolve(None, {"learning_rate": 1e-4})
    optimizer, _ = build_optimizer(cfg.optim, model, device)
    scaler = build_scaler(precision, model, device)

    def step():
        train_step(model, optimizer, scaler, iter(p["batches"]), 1, 1.0, device, precision,
                   layout=family_of(model).layout, objective=objective)

    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    return allocated_peak(step, held_by(model, optimizer)) + (
        4 * count_params(model) if objective is not None else 0
    )


def estimate(p: dict, precision: str, device: torch.device) -> float:
    model = p["model"]
    settings = {k: p[k] for k in ("packing", "reference") if k in p}
    cfg = config.resolve(None, {"mode": p["mode"], "batch_size": p["batch"], **settings})
    shape = row_shape(p.get("dataset"), p.get("collate"), p["max_length"], p["mode"], family_of(model).layout)
    return estimate_for_run(
        model.config,
        count_params(model),
        cfg,
        shape["max_length"],
        precision,
        device.type,
        target_length=shape.get("target_length"),
        packed=shape.get("packed"),
    )["peak"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--paths", nargs="+", default=list(GPU_TERMS), choices=list(GPU_TERMS))
    parser.add_argument("--precision", nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--sizes", nargs="+", type=int, default=[0, 1], choices=[0, 1])
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_num_threads(1)  # steadier on a shared CPU; the bytes do not depend on it
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else ("CPU, the allocator's events "
                                                                              "(torch.profiler)")
    print(f"measured on: {where}; torch {torch.__version__}")
    print(
        "| path | size | precision | estimate MB | measured MB | error | GPU-only terms the estimate adds |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in args.paths:
        for size in args.sizes:
            for precision in args.precision:
                p = path(name, size)
                shape = f"{p['batch']} x {p['max_length']}" + (", width 256" if size else ", width 128")
                est, peak = estimate(p, precision, device), measure(p, precision, device)
                print(f"| {name} | {shape} | {precision} | {est / MIB:,.1f} | {peak / MIB:,.1f} | "
                      f"{(est - peak) / peak:+.1%} | {GPU_TERMS[name]} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
