"""Model FLOPs utilisation: how much of the GPU's datasheet peak the training run turns into model math.

MFU answers "is the GPU busy doing useful work?" better than nvidia-smi's GPU %, which only says a kernel
was running. The count and the peaks follow nanoGPT's estimate_mfu and torchtitan's get_peak_flops.
"""

import re
from typing import NamedTuple

from train.core.errors import UsageError

PRECISIONS = ("fp32", "fp16", "bf16")


def flops_per_token(n_params: int, n_layer: int, n_head: int, head_dim: int, seq_len: int) -> float:
    """Training FLOPs per token: 6*N + 12*L*H*Q*T (PaLM appendix B, as nanoGPT and torchtitan count it).

    6*N is forward (2N) plus backward (4N) for every weight; 12*L*H*Q*T is the attention score and
    value matmuls, which have no weights. Callers pass the total parameter count, embeddings
    included (nanoGPT's estimate_mfu does the same), so MFU stays comparable with theirs; the tied
    embedding lookup costs no matmul, so this slightly over-counts and never flatters MFU much.
    """
    for name, value in (("n_params", n_params), ("n_layer", n_layer), ("n_head", n_head),
                        ("head_dim", head_dim), ("seq_len", seq_len)):
        if value <= 0:
            raise ValueError(f"flops_per_token: {name} must be > 0, got {value}")
    return float(6 * n_params + 12 * n_layer * n_head * head_dim * seq_len)


class Peak(NamedTuple):
    """Dense (no 2:4 sparsity) peak TFLOP/s. fp32 is the plain CUDA-core rate; tf32 / bf16 / fp16 are
    tensor-core rates with FP32 accumulate (what autocast uses). None: the device has no such unit."""

    fp32: float
    tf32: float | None
    bf16: float | None
    fp16: float | None


# Keys are matched as whole words in the lower-cased device name, longest key first, so "h100 pcie"
# wins over "h100", and "a10" never matches "A100" or "A10G". Datasheets quote sparse figures with
# an asterisk; the numbers here are the dense halves.
PEAK_TFLOPS: dict[str, Peak] = {
    # NVIDIA data centre
    "h100": Peak(67, 494.5, 989, 989),  # H100 SXM5 datasheet: FP32 67, TF32 989*, BF16/FP16 1979*
    "h100 pcie": Peak(51, 378, 756, 756),  # H100 PCIe datasheet: FP32 51, TF32 756*, BF16/FP16 1513*
    "h100 nvl": Peak(60, 417.5, 835, 835),  # H100 NVL datasheet: FP32 60, TF32 835*, BF16/FP16 1671*
    "h200": Peak(67, 494.5, 989, 989),  # H200 SXM datasheet: same compute as H100 SXM
    "h200 nvl": Peak(60, 417.5, 835, 835),  # H200 NVL datasheet: FP32 60, TF32 835*, BF16/FP16 1671*
    "gh200": Peak(67, 494.5, 989, 989),  # GH200 datasheet: the Hopper GPU at H100 SXM rates
    "a100": Peak(19.5, 156, 312, 312),  # A100 SXM4 and PCIe datasheet: FP32 19.5, TF32 156, BF16 312
    "l40s": Peak(91.6, 183, 362.05, 362.05),  # L40S datasheet: FP32 91.6, TF32 366*, BF16/FP16 733*
    "l40": Peak(90.5, 90.5, 181.05, 181.05),  # L40 datasheet: FP32 90.5, TF32 181*, BF16/FP16 362.1*
    "l4": Peak(30.3, 60, 121, 121),  # L4 datasheet: FP32 30.3, TF32 120*, BF16/FP16 242*
    "a10": Peak(31.2, 62.5, 125, 125),  # A10 datasheet: FP32 31.2, TF32 125*, BF16/FP16 250*
    # A10G (AWS G5): NVIDIA publishes no datasheet; AWS/Baseten figures, which match 80 SMs at
    # 1.71 GHz with GeForce-class half-rate FP32-accumulate tensor math.
    "a10g": Peak(35, 35, 70, 70),
    "v100": Peak(15.7, None, None, 125),  # V100 SXM2 datasheet: FP32 15.7, tensor (FP16) 125
    "v100 pcie": Peak(14, None, None, 112),  # V100 PCIe datasheet: FP32 14, tensor 112
    "v100s": Peak(16.4, None, None, 130),  # V100S PCIe datasheet: FP32 16.4, tensor 130
    "t4": Peak(8.1, None, None, 65),  # T4 datasheet: FP32 8.1, mixed FP16/FP32 65
    # NVIDIA workstation (full-rate FP32 accumulate)
    "a6000": Peak(38.7, 77.4, 154.8, 154.8),  # RTX A6000 datasheet: FP32 38.7, tensor 309.7*
    "rtx 6000 ada": Peak(91.1, 182.1, 364.2, 364.2),  # RTX 6000 Ada datasheet: FP32 91.1, FP8 1457*
    # GeForce: tensor math with FP32 accumulate runs at half the FP16-accumulate rate that the
    # marketing "AI TOPS" use. Figures from the Ampere GA102 / Ada / Blackwell whitepapers; Ti and
    # SUPER variants are SMs x boost clock x per-SM rate, the way the whitepapers derive theirs.
    "rtx 3060": Peak(12.7, 12.7, 25.5, 25.5),  # 28 SMs, 1777 MHz
    "rtx 3060 ti": Peak(16.2, 16.2, 32.4, 32.4),  # 38 SMs, 1665 MHz
    "rtx 3070": Peak(20.3, 20.3, 40.6, 40.6),  # GA104 whitepaper: FP16 w/ FP32 acc 40.6
    "rtx 3080": Peak(29.8, 29.8, 59.5, 59.5),  # GA102 whitepaper: FP16 w/ FP32 acc 59.5 (10 GB card)
    "rtx 3080 ti": Peak(34.1, 34.1, 68.2, 68.2),  # 80 SMs, 1665 MHz
    "rtx 3090": Peak(35.6, 35.6, 71, 71),  # GA102 whitepaper: FP16/BF16 w/ FP32 acc 71, TF32 35.6
    "rtx 3090 ti": Peak(40, 40, 80, 80),  # 84 SMs, 1860 MHz
    "rtx 4060": Peak(15.1, 15.1, 30.2, 30.2),  # 24 SMs, 2460 MHz
    "rtx 4060 ti": Peak(22.1, 22.1, 44.1, 44.1),  # 34 SMs, 2535 MHz
    "rtx 4070": Peak(29.1, 29.1, 58.3, 58.3),  # 46 SMs, 2475 MHz
    "rtx 4070 ti": Peak(40.1, 40.1, 80.2, 80.2),  # 60 SMs, 2610 MHz
    "rtx 4080": Peak(48.7, 48.7, 97.5, 97.5),  # Ada whitepaper: FP16 w/ FP32 acc 97.5
    "rtx 4080 super": Peak(52.2, 52.2, 104.4, 104.4),  # 80 SMs, 2550 MHz
    "rtx 4090": Peak(82.6, 82.6, 165.2, 165.2),  # Ada whitepaper: FP16/BF16 w/ FP32 acc 165.2
    "rtx 5080": Peak(56.3, 56.3, 112.6, 112.6),  # Blackwell whitepaper: 84 SMs, 2617 MHz
    "rtx 5090": Peak(104.8, 104.8, 209.5, 209.5),  # Blackwell whitepaper: FP16 w/ FP32 acc 209.5
    # AMD Instinct. An MI250/MI250X is two GCDs and PyTorch sees each as one device, so the peak per
    # device is half the package figure (torchtitan uses 191.5 for MI250X the same way).
    "mi250": Peak(22.65, None, 181.05, 181.05),  # MI250 datasheet: FP32 vector 45.3, BF16 362.1 (2 GCDs)
    "mi250x": Peak(23.95, None, 191.5, 191.5),  # MI250X datasheet: FP32 vector 47.9, BF16 383 (2 GCDs)
    "mi300x": Peak(163.4, 653.7, 1307.4, 1307.4),  # MI300X datasheet: FP32 vector 163.4, BF16 1307.4
}

# A key followed by one of these words names a different, usually smaller chip ("RTX 4090 Laptop
# GPU", "RTX 4070 SUPER", "RTX 4090 D"); without its own entry it is unknown, not the base card.
_VARIANT_WORDS = {"ti", "super", "d", "laptop", "mobile", "max"}


def _normalise(name: str) -> str:
    # "NVIDIA A100-SXM4-80GB", "Tesla V100-PCIE-16GB", "AMD Instinct MI250X/MI250" -> space separated
    return " ".join(re.sub(r"[-_/(),]", " ", name.lower()).split())


def match_device(device_name: str | None) -> str | None:
    """The PEAK_TFLOPS key for a device name (torch.cuda.get_device_name or NVML), or None if unknown."""
    if not device_name:
        return None
    name = _normalise(device_name)
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
        for found in re.finditer(rf"(?<![a-z0-9]){re.escape(key)}(?![a-z0-9])", name):
            following = name[found.end():].split()
            if following and following[0] in _VARIANT_WORDS:
                continue
            return key
    return None


def peak_flops(device_name: str | None, precision: str, tf32: bool = False) -> float | None:
    """Dense peak FLOP/s (not TFLOP/s) of one device at a training precision, or None when unknown.

    precision is fp32, fp16 or bf16. For fp32, tf32=True means matmuls run on TF32 tensor cores
    (torch.backends.cuda.matmul.allow_tf32); on a device without TF32 they run at the FP32 rate.
    A CPU, an unknown GPU or a precision the device lacks (bf16 on V100/T4) gives None: MFU is then
    reported as null instead of against a guessed peak.
    """
    if precision not in PRECISIONS:
        raise UsageError(f"PRECISION must be one of {', '.join(PRECISIONS)} for MFU, got {precision!r}")
    key = match_device(device_name)
    if key is None:
        return None
    peak = PEAK_TFLOPS[key]
    if precision == "fp32":
        tflops = peak.tf32 if tf32 and peak.tf32 is not None else peak.fp32
    else:
        tflops = getattr(peak, precision)
    return None if tflops is None else tflops * 1e12


def achieved_tflops(tokens_per_sec: float, flops_per_token: float) -> float:
    """Model TFLOP/s the run achieved (model math only; recomputation under checkpointing not counted)."""
    return tokens_per_sec * flops_per_token / 1e12


def mfu(tokens_per_sec: float | None, flops_per_token: float, peak: float | None) -> float | None:
    """MFU as a fraction (0.42 = 42 %) of the peak FLOP/s; None when the peak or the throughput is unknown.

    For several GPUs pass the run's total tokens/s and the summed peak (peak * world_size).
    """
    if peak is None or peak <= 0 or tokens_per_sec is None:
        return None
    return tokens_per_sec * flops_per_token / peak


def mfu_report(tokens_per_sec: float | None, flops_per_token: float, device_name: str | None,
               precision: str, tf32: bool = False, world_size: int = 1) -> dict:
    """The summary's MFU fields: achieved TFLOP/s, the peak used, MFU, and a note when MFU is null.

    device_name None means "not a GPU" (CPU, mps): no datasheet peak applies, so MFU is null.
    """
    peak = peak_flops(device_name, precision, tf32=tf32) if device_name else None
    total_peak = peak * world_size if peak else None
    note = None
    if tokens_per_sec is None:
        note = "no steady-state throughput: MFU not computed"
    elif device_name is None:
        note = "no GPU: MFU is measured against a GPU's datasheet peak, so it is null on this device"
    elif peak is None:
        note = (f"no dense {precision} peak known for {device_name!r}: MFU is null rather than a guess "
                "(add the device to PEAK_TFLOPS in train/core/measure/mfu.py)")
    return {
        "achieved_tflops": achieved_tflops(tokens_per_sec, flops_per_token) if tokens_per_sec else None,
        "peak_tflops": total_peak / 1e12 if total_peak else None,
        "mfu": mfu(tokens_per_sec, flops_per_token, total_peak),
        "mfu_note": note,
    }
