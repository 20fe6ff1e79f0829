"""Device, precision and math-mode decisions, each returned with the reason for it."""

from __future__ import annotations

import contextlib
import os
import platform
import time

import torch

from train.core.errors import UsageError


def resolve_device(name: str) -> tuple[torch.device, str]:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda"), "a CUDA/ROCm GPU is available"
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps"), "Apple mps is available"
        return torch.device("cpu"), "no GPU found"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"DEVICE={name}: no CUDA/ROCm GPU is visible to torch {torch.__version__}")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise UsageError(f"DEVICE={name}: only {torch.cuda.device_count()} GPU(s) visible")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise UsageError(f"DEVICE={name}: Apple mps is not available here")
    return device, "set by DEVICE"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        return "Apple mps"
    return platform.processor() or platform.machine() or "cpu"


def _cpu_autocast_works(dtype: torch.dtype) -> bool:
    try:
        with torch.autocast("cpu", dtype=dtype):
            (torch.ones(4, 4) @ torch.ones(4, 4)).sum().item()
        return True
    except (RuntimeError, TypeError):
        return False


def supports(device: torch.device, precision: str) -> bool:
    """Can this device train in this precision at all?"""
    if precision == "fp32":
        return True
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    if device.type == "cuda":
        if precision == "bf16":
            return torch.cuda.is_bf16_supported()
        return torch.cuda.get_device_capability(device) >= (5, 3)
    if device.type == "mps":
        return precision == "fp16" or torch.backends.mps.is_macos_or_newer(14, 0)
    return _cpu_autocast_works(dtype)


def _cpu_bf16_speedup() -> float:
    """Measure, don't assume: bf16 autocast vs fp32 on a transformer-sized matmul."""
    a, b = torch.randn(256, 1024), torch.randn(1024, 1024)

    def best(ctx) -> float:
        times = []
        for _ in range(5):
            with ctx():
                start = time.perf_counter()
                for _ in range(4):
                    a @ b
                times.append(time.perf_counter() - start)
        return min(times)

    fp32 = best(contextlib.nullcontext)
    bf16 = best(lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    return fp32 / bf16


def resolve_precision(requested: str, device: torch.device) -> tuple[str, str]:
    """The precision to train in and why. An explicit fp16/bf16 the device can't run stops."""
    if requested != "auto":
        if not supports(device, requested):
            variable = {"fp16": "ENABLE_FP16", "bf16": "ENABLE_BF16"}[requested]
            raise UsageError(
                f"{variable}: {device_name(device)} cannot train in {requested}; "
                "use PRECISION=auto to pick what it can"
            )
        return requested, "set by the launcher/flag"
    if device.type == "cuda":
        if supports(device, "bf16"):
            return "bf16", "the GPU has native bf16 (Ampere or newer): no loss scaling needed"
        if torch.cuda.get_device_capability(device) >= (7, 0):
            return "fp16", "tensor cores without bf16: fp16 with GradScaler"
        return "fp32", "no fast half-precision math on this GPU"
    if device.type == "mps":
        return "fp16", "Apple GPUs run fp16 natively"
    if not supports(device, "bf16"):
        return "fp32", "this CPU build has no bf16 autocast"
    speedup = _cpu_bf16_speedup()
    if speedup >= 1.3:
        return "bf16", f"measured: bf16 matmuls {speedup:.1f}x faster than fp32 on this CPU"
    return "fp32", f"measured: bf16 matmuls only {speedup:.1f}x fp32 on this CPU"


def autocast(device: torch.device, precision: str):
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    return torch.autocast(device.type, dtype=dtype)


def set_tf32(enabled: bool) -> None:
    """TF32 for fp32 matmuls and convolutions (Ampere and newer; a no-op elsewhere)."""
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


def attention_kernels(device: torch.device, shapes_vary: bool) -> str | None:
    """Why cuDNN's attention is off for this run, or None where it is on (or no CUDA). torch 2.11
    tries cuDNN's attention first on Hopper (sm_90) and newer, and cuDNN builds an execution plan
    for every new shape: on an H200 (2026-11-27) SFT from GPT-2 small ran 13,367 (grouped) and
    45,291 (packed) real tokens/s with the GPU busy 1 % and 23 % of a step, and 38,907 and 210,154
    with cuDNN's attention off. Pretraining's one fixed shape keeps it: there cuDNN's causal kernel
    is the fastest (0.86 ms forward + backward against flash's 1.20 for GPT-2 small's layer at
    32 x 1024; bench/sdpa_backends.py). Runs whose batches change shape step to step (SFT, preference
    training) take flash / memory-efficient attention instead; pretraining keeps cuDNN. A process-wide
    switch: set for every plan made in the process (find-batch's, then the run's)."""
    if device.type != "cuda":
        return None
    torch.backends.cuda.enable_cudnn_sdp(not shapes_vary)
    if not shapes_vary:
        return None
    return ("the batches change shape from step to step, and cuDNN builds an execution plan for each new "
            "shape (the GPU idles while it does)")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def memory_capacity(device: torch.device, max_memory_mb: int | None = None) -> tuple[int | None, str]:
    """(bytes, what) a run on `device` can fill at most: MAX_MEMORY_MB or the GPU's memory on
    CUDA, the host's RAM elsewhere (the CPU, and mps, whose memory is the host's). None when
    unknown. Read from properties: nothing is allocated."""
    if device.type == "cuda":
        if max_memory_mb:
            return max_memory_mb * 2**20, f"MAX_MEMORY_MB={max_memory_mb}"
        return torch.cuda.get_device_properties(device).total_memory, f"this GPU ({device_name(device)})"
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "this machine's RAM"
    except (ValueError, OSError, AttributeError):
        return None, "unknown"
