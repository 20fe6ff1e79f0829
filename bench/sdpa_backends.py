"""Which scaled-dot-product attention kernel is fastest for the kit's shapes on this GPU: flash,
cuDNN and memory-efficient attention, forward + backward, causal, bf16, one kernel at a time, then
a GPT-2 small forward + backward (transformers, attn_implementation="sdpa", eager) under each.
Prints ms and TFLOP/s per kernel. Needs CUDA; says so and exits 0 without it.

    python bench/sdpa_backends.py [--batch 32] [--length 1024] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import sys

import torch


def _time(fn, steps: int = 20, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--compiled", action="store_true",
                    help="also a compiled GPT-2 small training step (fused AdamW) with dropout 0.1 (GPT-2's) "
                         "and 0.0")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("sdpa_backends: no CUDA GPU here")
        return 0
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
    b, h, t, d = args.batch, 12, args.length, 64
    flops = 4 * b * h * t * t * d * 0.5 * 3.5  # causal: half; forward 1x + backward 2.5x
    results: dict = {"shape": [b, h, t, d], "kernel": {}, "gpt2_small_step_ms": {}}
    q, k, v = (
        torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
    )
    for name, backend in backends.items():
        def step(backend=backend):
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        try:
            ms = _time(step)
        except RuntimeError as exc:
            print(f"{name:>9}: not available ({str(exc).splitlines()[0][:100]})")
            continue
        results["kernel"][name] = ms
        print(f"{name:>9}: {ms:8.2f} ms fwd+bwd  {flops / ms / 1e9:7.1f} TFLOP/s  (B={b} H={h} T={t} D={d})")
    from transformers import GPT2Config, GPT2LMHeadModel
    model = GPT2LMHeadModel(GPT2Config(n_positions=t, attn_implementation="sdpa")).cuda()
    ids = torch.randint(0, 50257, (b, t), device="cuda")
    for name, backend in backends.items():
        if name not in results["kernel"]:
            continue
        def step(backend=backend):
            with sdpa_kernel(backend), torch.autocast("cuda", torch.bfloat16):
                model(input_ids=ids, labels=ids).loss.backward()
        ms = _time(step, steps=10, warmup=3)
        results["gpt2_small_step_ms"][name] = ms
        print(f"GPT-2 small {b} x {t} fwd+bwd, eager, bf16 autocast, {name:>9}: {ms:8.1f} ms  "
              f"{b * t / ms * 1e3:10,.0f} tokens/s")
    if args.compiled:
        results["compiled"] = {p: compiled_step(b, t, p) for p in (0.1, 0.0)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def compiled_step(b: int, t: int, dropout: float, steps: int = 10) -> dict:
    """A compiled GPT-2 small training step at this dropout (every GPT-2 dropout): ms, tokens/s
    and the sdpa call's arguments as dynamo traced them."""
    from torch._inductor.compile_fx import compile_fx
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_positions=t, attn_implementation="sdpa", resid_pdrop=dropout, embd_pdrop=dropout,
                     attn_pdrop=dropout)  # use_cache left on: no packing look, is_causal (see sdpa_kwargs)
    model = GPT2LMHeadModel(cfg).cuda().train()
    seen = []

    def backend(gm, example):
        for node in gm.graph.nodes:
            if "scaled_dot_product" in str(node.target):
                seen.append({k: str(v) for k, v in node.kwargs.items()})
        return compile_fx(gm, example)

    compiled = torch.compile(model, backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(0, 50257, (b, t), device="cuda")

    def step():
        with torch.autocast("cuda", torch.bfloat16):
            compiled(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    ms = _time(step, steps=steps, warmup=3)
    out = {"ms": ms, "tokens_per_s": b * t / ms * 1e3, "sdpa_kwargs": seen[:1]}
    print(f"compiled GPT-2 small {b} x {t}, dropout {dropout}: {ms:7.1f} ms/step  "
          f"{out['tokens_per_s']:10,.0f} tokens/s  "
          f"sdpa {seen[:1]}")
    return out


if __name__ == "__main__":
    sys.exit(main())
