"""FLOPs per token and datasheet peaks: the two numbers every MFU figure in the kit rests on."""

import pytest

from train.core.errors import UsageError
from train.core.measure.mfu import (
    PEAK_TFLOPS,
    achieved_tflops,
    flops_per_token,
    match_device,
    mfu,
    peak_flops,
)

# GPT-2 small as Hugging Face counts it (wte tied with lm_head, counted once).
GPT2_SMALL_PARAMS = 124_439_808


def test_flops_per_token_gpt2_small_by_hand():
    got = flops_per_token(GPT2_SMALL_PARAMS, n_layer=12, n_head=12, head_dim=64, seq_len=1024)
    assert got == 6 * GPT2_SMALL_PARAMS + 12 * 12 * 12 * 64 * 1024
    assert got == 746_638_848 + 113_246_208 == 859_885_056


def test_flops_per_token_rejects_nonsense():
    with pytest.raises(ValueError, match="seq_len"):
        flops_per_token(1000, 2, 2, 16, 0)


@pytest.mark.parametrize(
    ("name", "precision", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989e12),  # SXM
        ("NVIDIA H100 PCIe", "bf16", 756e12),
        ("NVIDIA H100 NVL", "bf16", 835e12),
        ("NVIDIA H200", "bf16", 989e12),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312e12),
        ("NVIDIA A100 80GB PCIe", "fp16", 312e12),
        ("NVIDIA A100-SXM4-40GB", "fp32", 19.5e12),
        ("NVIDIA L40S", "bf16", 362.05e12),
        ("NVIDIA L4", "bf16", 121e12),
        ("NVIDIA A10", "bf16", 125e12),
        ("NVIDIA A10G", "bf16", 70e12),
        ("NVIDIA RTX A6000", "bf16", 154.8e12),
        ("NVIDIA RTX 6000 Ada Generation", "bf16", 364.2e12),
        ("NVIDIA GeForce RTX 4090", "bf16", 165.2e12),  # dense, FP32 accumulate
        ("NVIDIA GeForce RTX 4090", "fp32", 82.6e12),
        ("NVIDIA GeForce RTX 3090", "bf16", 71e12),
        ("NVIDIA GeForce RTX 5090", "bf16", 209.5e12),
        ("Tesla V100-SXM2-16GB", "fp16", 125e12),
        ("Tesla V100-PCIE-32GB", "fp16", 112e12),
        ("Tesla T4", "fp16", 65e12),
        ("AMD Instinct MI300X", "bf16", 1307.4e12),
        ("AMD Instinct MI250X/MI250", "bf16", 191.5e12),  # per GCD, as PyTorch sees it
    ],
)
def test_peak_matches_datasheet(name, precision, expected):
    assert peak_flops(name, precision) == pytest.approx(expected)


def test_longest_key_wins():
    assert match_device("NVIDIA H100 PCIe") == "h100 pcie"
    assert match_device("NVIDIA H100 80GB HBM3") == "h100"
    assert match_device("NVIDIA L40S") == "l40s"
    assert match_device("NVIDIA L40") == "l40"
    assert match_device("NVIDIA A100-PCIE-40GB") == "a100"
    assert match_device("NVIDIA A10G") == "a10g"
    assert match_device("nvidia geforce rtx 4090") == "rtx 4090"  # case-insensitive
    assert match_device("NVIDIA GeForce RTX 4070 Ti") == "rtx 4070 ti"


@pytest.mark.parametrize(
    "name",
    [
        None,
        "",
        "cpu",
        "NVIDIA GeForce RTX 409",  # a prefix of a key is not the key
        "NVIDIA GeForce RTX 40900",
        "NVIDIA GeForce RTX 4090 Laptop GPU",  # a different, smaller chip
        "NVIDIA GeForce RTX 4090 D",
        "NVIDIA GeForce RTX 4070 SUPER",  # variant without its own entry: unknown, not the base card
        "Quadro RTX 6000",
        "NVIDIA GH100 engineering sample",
        "Intel(R) Data Center GPU Max 1550",
    ],
)
def test_unknown_device_is_none(name):
    assert peak_flops(name, "bf16") is None


def test_precision_without_units_is_none():
    assert peak_flops("Tesla V100-SXM2-16GB", "bf16") is None
    assert peak_flops("Tesla T4", "bf16") is None


def test_tf32_only_where_the_device_has_it():
    assert peak_flops("NVIDIA A100-SXM4-80GB", "fp32", tf32=True) == pytest.approx(156e12)
    assert peak_flops("NVIDIA A100-SXM4-80GB", "fp32", tf32=False) == pytest.approx(19.5e12)
    # V100 has no TF32: matmuls run at the FP32 rate
    assert peak_flops("Tesla V100-SXM2-16GB", "fp32", tf32=True) == pytest.approx(15.7e12)


def test_bad_precision_is_a_usage_error():
    with pytest.raises(UsageError, match="PRECISION"):
        peak_flops("NVIDIA H100", "fp8")


def test_table_is_dense_and_ordered():
    for key, peak in PEAK_TFLOPS.items():
        assert key == key.lower()
        assert peak.fp32 > 0
        for tensor in (peak.tf32, peak.bf16, peak.fp16):
            assert tensor is None or tensor >= peak.fp32 / 2, key  # no sparse figure sneaks in
        if peak.bf16 is not None:
            assert peak.bf16 == peak.fp16, key


def test_mfu_arithmetic():
    fpt = flops_per_token(GPT2_SMALL_PARAMS, 12, 12, 64, 1024)
    peak = peak_flops("NVIDIA A100-SXM4-40GB", "bf16")
    tokens_per_sec = 150_000
    assert achieved_tflops(tokens_per_sec, fpt) == pytest.approx(150_000 * 859_885_056 / 1e12)
    assert mfu(tokens_per_sec, fpt, peak) == pytest.approx(150_000 * 859_885_056 / 312e12)
    assert 0.41 < mfu(tokens_per_sec, fpt, peak) < 0.42
    assert mfu(tokens_per_sec, fpt, None) is None
    assert mfu(None, fpt, peak) is None


def test_mfu_report_fields_and_notes():
    from train.core.measure.mfu import mfu_report

    fpt = flops_per_token(124_000_000, 12, 12, 64, 1024)
    report = mfu_report(100_000.0, fpt, "NVIDIA H100 80GB HBM3", "bf16")
    assert report["peak_tflops"] == 989 and report["mfu_note"] is None
    assert report["achieved_tflops"] == pytest.approx(100_000 * fpt / 1e12)
    assert report["mfu"] == pytest.approx(100_000 * fpt / 989e12)
    two = mfu_report(200_000.0, fpt, "NVIDIA H100 80GB HBM3", "bf16", world_size=2)
    assert two["mfu"] == pytest.approx(report["mfu"]) and two["peak_tflops"] == 2 * 989

    unknown = mfu_report(100_000.0, fpt, "Some Future GPU 9000", "bf16")
    assert unknown["mfu"] is None and unknown["peak_tflops"] is None
    assert "Some Future GPU 9000" in unknown["mfu_note"] and unknown["achieved_tflops"] is not None
    cpu = mfu_report(500.0, fpt, None, "fp32")
    assert cpu["mfu"] is None and "no GPU" in cpu["mfu_note"]
    assert mfu_report(None, fpt, "NVIDIA A100-SXM4-80GB", "bf16")["mfu"] is None
