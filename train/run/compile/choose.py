"""COMPILE and COMPILE_MODE as the plan decides them, each with its reason (config.json's decisions).

COMPILE empty: on with a CUDA GPU, off on a CPU. On an H200 the kit's small models trained eager
left the GPU idle most of each step: T5 small SFT ran at 0.7 % MFU with the GPU busy 24 % of the
time, its step 1,164 matmul launches and 29 ms of host work, while GPT-2 small pretraining compiled
reached 39 % MFU. Inductor fuses the elementwise kernels between the matmuls, so fewer launches
remain. On a CPU there is no launch to save and inductor's C++ build takes longer than a demo
run trains (bench/RESULTS.md, "Kernel launches per step").

COMPILE_MODE empty: reduce-overhead (CUDA graphs: a step's kernels replayed by one launch) where
the step is still launch-bound after compiling: one process, shapes from a bounded set (fixed
windows, or the length buckets of SFT, DPO and GRPO's loss), and a micro-batch whose math at the GPU's peak
takes under LAUNCH_BOUND_MS. Elsewhere default: a larger step hides the launches behind its math,
and CUDA graphs would only add a memory pool per shape.
"""

from __future__ import annotations

import torch

from train.core.measure.mfu import peak_flops
from train.core.objective import mode_of
from train.models.flops import model_flops_per_token, sample_lengths
from train.run.compile.cuda_graphs import GRAPHS

# The host side of an eager step measured on an H200: 29 ms (T5 small SFT, 1,164 matmul launches).
# A micro-batch whose math at the device's peak takes less waits on launches more than on math.
LAUNCH_BOUND_MS = 20.0


def compile_default(device: torch.device, sharding: str) -> tuple[bool, str]:
    """(COMPILE's value when empty, why)."""
    if device.type != "cuda":
        return False, (f"{device.type}: no kernel launches to save, and inductor's build takes longer than a "
                       f"short run here gains (COMPILE=1 to compile anyway)")
    if sharding != "none":
        return False, (f"SHARDING={sharding}: the kit compiles the whole model, where FSDP2 wants each block "
                       "compiled on its own, as torchtitan does (COMPILE=1 to try)")
    return True, ("a GPU: fused kernels, fewer launches (a small model's eager step leaves the GPU waiting "
                  "on the host); shapes bounded by the length buckets; COMPILE=0 for eager")


def decide_compile(cfg, device: torch.device, decide) -> None:
    """COMPILE empty -> the device's default, before the data (whose padding follows it)."""
    if cfg.model.compile is None:
        cfg.model.compile, why = compile_default(device, cfg.system.sharding)
        decide("compile", cfg.model.compile, why)


def step_math_ms(cfg, model, family, max_length: int, peak: float | None) -> float | None:
    """Milliseconds the largest micro-batch's forward and backward take at `peak` FLOP/s (6N +
    attention FLOPs per token, BATCH_SIZE x MAX_LENGTH tokens, x NUM_GENERATIONS for GRPO's rows, or
    TOKEN_BUDGET); None when the peak is unknown (a CPU, a GPU missing from core/measure/mfu.py's table)."""
    if not peak:
        return None
    rows = cfg.optim.num_generations if mode_of(cfg.run.mode).sampled else 1  # GRPO: a prompt's G completions
    tokens = cfg.data.token_budget or cfg.optim.batch_size * rows * max_length
    fpt = model_flops_per_token(model, *sample_lengths(family, cfg.run.mode, max_length))
    return 1e3 * fpt * tokens / peak


def choose_mode(compiled: bool, device: torch.device, world_size: int, sharding: str, packed: bool,
                math_ms: float | None) -> tuple[str, str]:
    """(COMPILE_MODE when empty, why). packed: PACKING's rows, whose varlen index takes a new
    shape with most batches (a CUDA graph each would be dozens, each holding its own buffers)."""
    if not compiled:
        return "default", "COMPILE=0"
    if device.type != "cuda":
        return "default", f"{device.type}: CUDA graphs need a CUDA GPU"
    if world_size > 1 or sharding != "none":
        return "default", (f"{world_size} processes, SHARDING={sharding}: gradient collectives run between a "
                           "graph's pieces; COMPILE_MODE=reduce-overhead to try")
    if packed:
        return "default", "PACKING: the varlen index changes shape with most batches, a CUDA graph for each"
    if math_ms is None:
        return "default", ("the GPU's peak FLOP/s is unknown: no estimate of whether launches or math bound "
                           "the step")
    if math_ms >= LAUNCH_BOUND_MS:
        return "default", (f"a micro-batch's math takes {math_ms:.1f} ms at the GPU's peak, at least "
                           f"{LAUNCH_BOUND_MS:.0f} ms: it hides the launches")
    return GRAPHS, (f"a micro-batch's math takes {math_ms:.1f} ms at the GPU's peak, under "
                    f"{LAUNCH_BOUND_MS:.0f} ms: "
                    "launch-bound, so each shape's step is replayed as CUDA graphs (one per length bucket; "
                    "the optimizer step stays outside); COMPILE_MODE=default to turn off")


def decide_mode(cfg, model, family, max_length: int, device: torch.device, precision: str, world_size: int,
                decide) -> None:
    """COMPILE_MODE empty -> reduce-overhead or default, once the model and micro-batch are known."""
    if cfg.model.compile_mode is not None or not cfg.model.compile:
        return
    peak = (
        peak_flops(torch.cuda.get_device_name(device), precision, cfg.system.tf32)
        if device.type == "cuda"
        else None
    )
    math_ms = step_math_ms(cfg, model, family, max_length, peak)
    cfg.model.compile_mode, why = choose_mode(
        True, device, world_size, cfg.system.sharding, cfg.data.packing, math_ms
    )
    decide("compile_mode", cfg.model.compile_mode, why)
