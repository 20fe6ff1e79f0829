"""What T5's attention launches and allocates in one training step: transformers' eager T5,
transformers' sdpa (the kit's path before T5_SDPA), and the kit's T5_SDPA (train/models/t5_attention.py:
the position bias folded with the mask once per forward).

One optimizer step through the kit's own train_step (forward_loss, backward, build_optimizer's AdamW) on
T5-small's attention shape (6 + 6 layers, 8 heads; the width narrowed to --d_model, which changes no op count
and no score-tensor size), at a pretraining batch (span corruption: sources of --source tokens, no padding)
and an SFT batch (sources and targets right-padded). Counted, not timed:
- profiler events: the aten ops torch.profiler records in the step (nested ones counted too);
- dispatched ops: the ops that reach a kernel (a TorchDispatchMode's count: on a GPU, about one
  launch each);
- score tensors: every fresh (not view, not in-place) tensor of four dims whose last two are a
  (query, key) length pair of the batch: masks, scores, their gradients; count and MB, forward and
  backward together.
On a CPU sdpa's fused kernel gives no gradient for attn_mask, so the self-attentions, whose bias
trains, run its math path (scores materialised, as eager's) on every path; --frozen_bias freezes
the bias tables so that every attention takes the fused kernel, as a GPU's memory-efficient kernel
does with a trainable bias: what remains score-shaped is then the masks and their gradients.

    .venv/bin/python bench/t5_attention.py [--batch 8 --source 128 --d_model 64 --threads 1] [--frozen_bias]
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from config import OptimConfig  # noqa: E402
from train.core.optim.registry import build_optimizer  # noqa: E402
from train.core.seq2seq import span_lengths  # noqa: E402
from train.core.step import train_step  # noqa: E402
from train.core.units import IGNORE_INDEX  # noqa: E402
from train.models.build import build_config, build_model  # noqa: E402
from train.models.family import ENCODER_DECODER  # noqa: E402

VOCAB = 512


class Allocations(TorchDispatchMode):
    """Counts dispatched ops, and the fresh tensors shaped like attention scores."""

    def __init__(self, pairs: set[tuple[int, int]]):
        super().__init__()
        self.pairs, self.ops, self.scores, self.score_bytes = pairs, 0, Counter(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        returns = func._schema.returns
        for i, t in enumerate(out if isinstance(out, (tuple, list)) else (out,)):
            aliased = i < len(returns) and returns[i].alias_info is not None  # a view or an in-place op
            if torch.is_tensor(t) and not aliased and t.dim() == 4 and tuple(t.shape[-2:]) in self.pairs:
                self.scores[str(func.overloadpacket)] += 1
                self.score_bytes += t.numel() * t.element_size()
        return out


def batch_of(kind: str, batch: int, source: int, target: int) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, VOCAB, (batch, source), generator=g)
    labels = torch.randint(2, VOCAB, (batch, target), generator=g)
    if kind == "pretrain":  # span corruption's windows: every row full, no mask
        return {"input_ids": ids, "labels": labels}
    src = torch.randint(source // 4, source + 1, (batch,), generator=g)
    src[0] = source
    tgt = torch.randint(target // 4, target + 1, (batch,), generator=g)
    mask = (torch.arange(source)[None] < src[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask,
            "labels": labels.masked_fill(torch.arange(target)[None] >= tgt[:, None], IGNORE_INDEX)}


def one_step(model, batch: dict, pairs: set, device: torch.device, precision: str) -> dict:
    optimizer, _ = build_optimizer(OptimConfig(learning_rate=1e-4), model, device)
    scaler = torch.amp.GradScaler(device.type, enabled=False)

    def step():
        return train_step(
            model, optimizer, scaler, iter([batch]), 1, 1.0, device, precision, layout=ENCODER_DECODER
        )

    step()  # warm: the optimizer's state exists, lazy inits are done
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        step()
    events = sum(1 for e in prof.events() if e.name.startswith("aten::"))
    kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    spy = Allocations(pairs)
    with spy:
        loss, _, _ = step()
    return {"events": events, "kernels": kernels if device.type == "cuda" else "-", "ops": spy.ops,
            "scores": sum(spy.scores.values()), "mb": spy.score_bytes / 2**20,
            "by_op": dict(spy.scores.most_common()), "loss": float(loss)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--source", type=int, default=128, help="MAX_LENGTH: the source tokens")
    parser.add_argument("--sft_target", type=int, default=64)
    parser.add_argument("--d_model", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--frozen_bias", action="store_true", help="the relative-bias tables untrained")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: its kernels counted too")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = build_config("small", None, VOCAB, 1, "t5")
    cfg.update(dict(d_model=args.d_model, d_ff=2 * args.d_model, d_kv=args.d_model // cfg.num_heads,
                    dropout_rate=0.0))
    pretrain_target = span_lengths(args.source)[1]
    if cfg.d_kv in (args.source, pretrain_target, args.sft_target):
        raise SystemExit(f"--d_model: a head width of {cfg.d_kv} equals a length: q, k and v would count as "
                         f"scores")
    kit = build_model(cfg, gradient_checkpointing=False, seed=0)
    print(f"T5-small's attention shape: {cfg.num_layers} + {cfg.num_decoder_layers} layers, {cfg.num_heads} "
          f"heads, "
          f"d_model {args.d_model}; batch {args.batch}; torch {torch.__version__}, {args.threads} thread(s), "
          f"{args.device}, {args.precision}"
          f"{'; bias tables frozen' if args.frozen_bias else ''}")
    device = torch.device(args.device)
    print("| batch | attention | profiler events | GPU kernels | dispatched ops | score-shaped tensors | MB "
          "| loss | largest |")
    print("|---|---|---|---|---|---|---|---|---|")
    for kind, target in (("pretrain", pretrain_target), ("sft", args.sft_target)):
        batch = batch_of(kind, args.batch, args.source, target)
        pairs = {(args.source, args.source), (target, target), (target, args.source)}
        label = f"{kind} {args.source} -> {target}"
        for name in ("eager", "sdpa", "t5_sdpa"):
            model = copy.deepcopy(kit).to(device)
            if name != "t5_sdpa":
                # the kit's hooks stand aside for any other implementation
                model.set_attn_implementation(name)
            for key, p in model.named_parameters():
                p.requires_grad_(not (args.frozen_bias and "relative_attention_bias" in key))
            r = one_step(model, batch, pairs, device, args.precision)
            largest = ", ".join(f"{op.removeprefix('aten.')} {n}" for op, n in r["by_op"].items())
            print(f"| {label} | {name} | {r['events']:,} | {r['kernels']} | {r['ops']:,} | {r['scores']} | "
                  f"{r['mb']:.1f} | {r['loss']:.6f} | {largest} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
