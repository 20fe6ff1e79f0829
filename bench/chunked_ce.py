"""Peak memory of the LM head + loss + backward: plain (all logits in fp32) vs chunked.

Each variant runs in a fresh process, so one's allocations cannot hide in the other's peak.
On CPU the figure is the growth of peak RSS (VmHWM, reset through /proc/self/clear_refs once
the inputs exist) during forward + backward; on CUDA, torch.cuda.max_memory_allocated over
what the inputs already hold. Usage, from the repository root:

    .venv/bin/python bench/chunked_ce.py [--vocab 32768] [--hidden 768] [--batch 8] [--seq 1024]
        [--chunk TOKENS] [--device cpu|cuda] [--precision fp32|bf16]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MIB = 2**20


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM := VmRSS
        return True
    except OSError:
        return False


def worker(args) -> dict:
    import torch
    import torch.nn.functional as F

    from train.core.loss import chunked_cross_entropy

    device = torch.device(args.device)
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(args.batch, args.seq, args.hidden, device=device, generator=g, requires_grad=True)
    weight = (0.02 * torch.randn(args.vocab, args.hidden, device=device, generator=g)).requires_grad_()
    labels = torch.randint(0, args.vocab, (args.batch, args.seq), device=device, generator=g)
    labels[:, : args.seq // 4] = -100  # a prompt's worth of ignored tokens, as in SFT
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16")

    def plain():
        with autocast:
            logits = F.linear(hidden, weight)
        loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, args.vocab), labels[:, 1:].reshape(-1),
                               ignore_index=-100, reduction="sum")
        loss.backward()
        return loss

    def chunked():
        with autocast:
            loss, _ = chunked_cross_entropy(hidden, weight, labels, chunk_tokens=args.chunk)
        loss.backward()
        return loss

    run = plain if args.worker == "plain" else chunked
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    rss_reset = _reset_peak_rss()
    rss_base = _status_kib("VmRSS")
    start = time.perf_counter()
    loss = run()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    out = {
        "variant": args.worker,
        "loss": loss.item(),
        "seconds": seconds,
        "rss_peak_growth_mib": (_status_kib("VmHWM") - rss_base) / 1024 if rss_reset else None,
        "grad_norm": float(torch.linalg.vector_norm(weight.grad)),
    }
    if device.type == "cuda":
        out["cuda_peak_growth_mib"] = (torch.cuda.max_memory_allocated() - base) / MIB
        out["device_name"] = torch.cuda.get_device_name(device)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=None, help="tokens per chunk (default: "
                                                                "train.core.loss's)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda where there is one)")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--worker", choices=("plain", "chunked"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    flags = [f"--{k}={v}" for k, v in vars(args).items() if v is not None and k != "worker"]
    results = []
    for variant in ("plain", "chunked"):
        proc = subprocess.run([sys.executable, __file__, *flags, f"--worker={variant}"],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            print(
                proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"{variant} failed",
                file=sys.stderr,
            )
            return 1
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    tokens = args.batch * args.seq
    print(f"LM head + cross-entropy + backward: {args.batch} x {args.seq} tokens, hidden {args.hidden}, "
          f"vocab {args.vocab}, {args.precision}, {args.device}; fp32 logits alone = "
          f"{tokens * args.vocab * 4 / MIB:,.0f} MiB")
    cuda = "cuda_peak_growth_mib" in results[0]
    header = f"{'variant':<9}{'peak RSS growth MiB':>21}" + (f"{'CUDA peak MiB':>15}" if cuda else "")
    print(header + f"{'seconds':>9}{'loss':>16}")
    for r in results:
        rss = "n/a" if r["rss_peak_growth_mib"] is None else f"{r['rss_peak_growth_mib']:,.0f}"
        line = f"{r['variant']:<9}{rss:>21}" + (f"{r['cuda_peak_growth_mib']:>15,.0f}" if cuda else "")
        print(line + f"{r['seconds']:>9.2f}{r['loss']:>16.4f}")
    plain, chunked = results
    key = "cuda_peak_growth_mib" if cuda else "rss_peak_growth_mib"
    if plain[key] and chunked[key]:
        print(f"chunked peak = {chunked[key] / plain[key]:.1%} of plain; "
              f"loss difference {abs(plain['loss'] - chunked['loss']) / abs(plain['loss']):.1e} (relative)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
