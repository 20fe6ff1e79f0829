"""What each part of a training step costs beside forward/backward, in thread CPU time.

Wall time on a shared machine swings by tens of percent; the parts measured here are short, so
interleaving them many times and taking medians of thread CPU time gives tight figures. They
explain the kit/plain ratio that `python -m train bench --vs-plain` measures end to end
(bench/RESULTS.md). Usage, from the repository root:

    .venv/bin/python bench/step_parts.py [--model_size nano] [--batch_size 8] [--repeats 40]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def thread_ms(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        out.append(1000 * (time.thread_time() - start))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_size", default="nano")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args()

    import torch

    import config
    from train.core.optim.registry import build_optimizer
    from train.data.stream import BatchStream
    from train.run.loop.parts import data_loader
    from train.run.plan.build import build

    torch.set_num_threads(1)
    cfg = config.resolve(
        None, {"model_size": args.model_size, "batch_size": args.batch_size, "max_steps": 10}
    )
    b = build(cfg, lambda line: None)
    model, params = b.model, list(b.model.parameters())
    stream = BatchStream(*data_loader(b, b.cfg.optim.batch_size), b.cfg.optim.batch_size)
    x = next(stream)["input_ids"]

    def forward_backward():
        model(x, labels=x).loss.backward()

    forward_backward()  # gradients for the optimizers and the clip to work on
    kit_opt, kind = build_optimizer(cfg.optim, model, b.device)
    parts = {
        "AdamW torch default (plain loop)": torch.optim.AdamW(params, lr=1e-4).step,
        "AdamW foreach=True": torch.optim.AdamW(params, lr=1e-4, foreach=True).step,
        "AdamW fused=True": torch.optim.AdamW(params, lr=1e-4, fused=True).step,
        f"kit build_optimizer ({kind}, 2 groups)": kit_opt.step,
        "clip_grad_norm_ (kit, GRAD_CLIP=1)": lambda: torch.nn.utils.clip_grad_norm_(params, 1.0),
        "DataLoader next batch (0 workers)": lambda: next(stream),
    }
    samples: dict[str, list[float]] = {name: [] for name in parts}
    for fn in parts.values():
        fn()  # optimizer state allocated, loader started
    for _ in range(args.repeats):  # interleaved, so a change in load hits every part alike
        for name, fn in parts.items():
            samples[name] += thread_ms(fn, 1)
    samples["forward + backward"] = thread_ms(forward_backward, max(3, args.repeats // 8))
    print(
        f"{args.model_size}, batch {args.batch_size} x {b.max_length} tokens, 1 thread, thread CPU ms "
        f"(median, quartiles)"
    )
    for name, values in samples.items():
        q1, _, q3 = statistics.quantiles(values, n=4)
        print(f"  {name:40s} {statistics.median(values):9.2f}   ({q1:.2f}-{q3:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
