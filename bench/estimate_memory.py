"""Peak-memory estimate (train/core/measure/estimate.py) against a measured peak, through the kit's own
optimizer and train_step.

On a GPU: torch.cuda.max_memory_allocated over three optimizer steps of random tokens.
Without one (or with --fake): torch's MemTracker under FakeTensorMode, which counts every
tensor the same step creates without allocating it; CPU kernels, so attention with dropout
takes sdpa's math path there (the estimate is told the device) and autocast follows the CPU
op lists, which differ from CUDA's: trust the fp32 rows most.

    .venv/bin/python bench/estimate_memory.py --sizes small medium --batch_sizes 4 8 --precision bf16
Prints one row per setting: estimate, measured, and the estimate's error.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import config  # noqa: E402
from train.core.model import padded_vocab
from train.core.step import build_optimizer, train_step  # noqa: E402
from train.core.units import MIB  # noqa: E402
from train.distributed.parallel import build_scaler  # noqa: E402
from train.models.build import build_config, build_model  # noqa: E402
from train.models.estimate import count_params, estimate_memory  # noqa: E402


def measure(hf_cfg, batch_size, max_length, precision, ckpt, accum, device, fake) -> float:
    """Peak bytes over three optimizer steps of the kit's train_step."""
    cfg = config.resolve(None, {"batch_size": batch_size, "gradient_accumulation_steps": accum})

    def steps(model, tracker=None):
        optimizer, _ = build_optimizer(cfg.optim, model, device)
        scaler = build_scaler(precision, model, device)
        ids = torch.randint(0, hf_cfg.vocab_size, (batch_size, max_length), device=device)
        batches = iter([{"input_ids": ids}] * (3 * accum))
        for _ in range(3):
            train_step(model, optimizer, scaler, batches, accum, 1.0, device, precision, source_target=False)
            if tracker is not None:
                tracker.reset_mod_stats()  # per-module stats are per iteration; the peak stays

    if not fake:
        model = build_model(hf_cfg, ckpt, 0).to(device)
        torch.cuda.reset_peak_memory_stats(device)
        steps(model)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        del model
        torch.cuda.empty_cache()
        return peak
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    with FakeTensorMode():
        model = build_model(hf_cfg, ckpt, 0)
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            steps(model, tracker)
        return tracker.get_tracker_snapshot("peak")[device]["Total"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["small", "medium"])
    parser.add_argument("--batch_sizes", nargs="+", type=int, default=[4, 8])
    parser.add_argument("--max_length", type=int, default=1024)
    parser.add_argument("--precision", nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--gradient_checkpointing", nargs="+", type=int, default=[0])
    parser.add_argument("--accum", type=int, default=1)
    parser.add_argument(
        "--vocab", type=int, default=50257, help="tokenizer size (padded to 64, as the kit does)"
    )
    parser.add_argument("--dropout", type=float, default=None, help="override the config's dropout")
    parser.add_argument("--fake", action="store_true", help="MemTracker on CPU even when a GPU is present")
    args = parser.parse_args()
    fake = args.fake or not torch.cuda.is_available()
    device = torch.device("cpu" if fake else "cuda")
    where = "MemTracker/FakeTensorMode on CPU" if fake else torch.cuda.get_device_name(device)
    print(f"measured on: {where}; torch {torch.__version__}; max_length {args.max_length}")
    print("| model | batch | precision | grad ckpt | estimate MB | measured MB | error |")
    print("|---|---|---|---|---|---|---|")
    for size in args.sizes:
        hf_cfg = build_config(size, None, padded_vocab(args.vocab), 0)
        if args.dropout is not None:
            hf_cfg.resid_pdrop = hf_cfg.embd_pdrop = hf_cfg.attn_pdrop = args.dropout
        hf_cfg._attn_implementation = "sdpa"
        n_params = count_params(hf_cfg)
        for precision in args.precision:
            for ckpt in args.gradient_checkpointing:
                for batch in args.batch_sizes:
                    est = estimate_memory(
                        hf_cfg, n_params, batch_size=batch, max_length=args.max_length, precision=precision,
                        gradient_checkpointing=bool(ckpt), gradient_accumulation_steps=args.accum,
                        device_type=device.type,
                    )["peak"]  # fmt: skip
                    peak = measure(
                        hf_cfg, batch, args.max_length, precision, bool(ckpt), args.accum, device, fake
                    )
                    print(
                        f"| {size} | {batch} | {precision} | {ckpt} | {est / MIB:,.0f} | {peak / MIB:,.0f} "
                        f"| {(est - peak) / peak:+.1%} |",
                        flush=True,
                    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
