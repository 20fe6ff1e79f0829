"""Memory-adaptive settings at start, EFFECTIVE_BATCH and LR_SCALING: each decision logged with
its numbers, the effective batch never changed silently."""

import math

import numpy as np
import pytest
import torch

import config
from train.core.errors import UsageError
from train.data.text import PackedDataset
from train.run.plan.adapt import adapt, scaled_lr

CPU = torch.device("cpu")


@pytest.fixture
def dataset(tmp_path):
    path = tmp_path / "tokens.bin"
    tokens = np.memmap(path, dtype=np.uint16, mode="w+", shape=(64 * 1024,))
    tokens.flush()
    return PackedDataset(np.memmap(path, dtype=np.uint16, mode="r", shape=(64 * 1024,)), 64)


def decisions(cfg, dataset, host, device=CPU) -> dict:
    made = {}
    adapt(
        cfg,
        device,
        dataset,
        lambda setting, value, reason: made.setdefault(setting, (value, reason)),
        host=host,
    )
    return made


ROOMY = {"ram_available_mb": 64000.0, "swap_used_pct": 0.0}


def test_lr_scaling_rules():
    assert scaled_lr(6e-4, 256, 128, "linear")[0] == pytest.approx(1.2e-3)
    assert scaled_lr(6e-4, 32, 128, "sqrt")[0] == pytest.approx(3e-4)
    assert scaled_lr(6e-4, 32, 128, "none") == (6e-4, "kept")
    assert scaled_lr(6e-4, 128, 128, "linear") == (6e-4, "kept")


def test_reference_is_the_presets_effective_batch_and_lr_follows_it(dataset):
    cfg = config.resolve("optimized", {"batch_size": 16, "lr_scaling": "sqrt", "learning_rate": 1e-3})
    assert cfg.optim.lr_reference_batch == 128
    made = decisions(cfg, dataset, ROOMY)
    assert cfg.optim.learning_rate == pytest.approx(1e-3 * math.sqrt(64 / 128))
    assert "LR_SCALING=sqrt" in made["learning_rate"][1] and "64/128" in made["learning_rate"][1]
    assert config.resolve("baseline", {}).optim.lr_reference_batch == 8
    assert config.resolve(None, {"lr_reference_batch": 512}).optim.lr_reference_batch == 512


def test_effective_batch_sets_accumulation_openly(dataset):
    cfg = config.resolve(None, {"batch_size": 8, "effective_batch": 64})
    made = decisions(cfg, dataset, ROOMY)
    assert cfg.optim.gradient_accumulation_steps == 8 and cfg.effective_batch_size() == 64
    assert "EFFECTIVE_BATCH=64" in made["gradient_accumulation_steps"][1]
    assert "learning_rate" not in made  # LR_SCALING=none: the LR is left alone, and nothing is said


def test_low_host_ram_means_fewer_workers_and_no_pinning(dataset):
    cfg = config.resolve("optimized", {"batch_size": 4})
    made = decisions(cfg, dataset, {"ram_available_mb": 1900.0, "swap_used_pct": 35.0})
    assert cfg.data.num_workers == 2 and made["num_workers"][0] == 2  # (1900 - 1024) // 400
    assert "1900 MB RAM available" in made["num_workers"][1] and "swap 35 %" in made["num_workers"][1]
    assert cfg.data.pin_memory is False and "no CUDA" in made["pin_memory"][1]
    assert cfg.effective_batch_size() == 16  # untouched


def test_roomy_host_keeps_workers_and_reads_tokens_into_ram(dataset):
    cfg = config.resolve("optimized", {})
    made = decisions(cfg, dataset, ROOMY)
    assert cfg.data.num_workers == 4 and made["num_workers"][1].startswith("kept")
    assert made["token_cache"][0] == "ram" and not isinstance(dataset.tokens, np.memmap)
    assert dataset[3]["input_ids"].shape == (64,)


def test_no_ram_to_spare_means_no_workers_and_tokens_left_on_disk(dataset):
    cfg = config.resolve("optimized", {})
    made = decisions(cfg, dataset, {"ram_available_mb": 0.5, "swap_used_pct": 0.0})
    assert cfg.data.num_workers == 0 and cfg.data.prefetch_factor is None and not cfg.data.persistent_workers
    assert made["token_cache"][0] == "memmap" and isinstance(dataset.tokens, np.memmap)


def test_prefetch_shrinks_when_batches_in_flight_would_crowd_ram(dataset):
    cfg = config.resolve("optimized", {"batch_size": 65536})  # 32 MB per micro-batch of int64 ids
    made = decisions(cfg, dataset, {"ram_available_mb": 1024.0 + 4 * 400 + 100, "swap_used_pct": 0.0})
    assert cfg.data.num_workers == 4 and cfg.data.prefetch_factor == 1  # 4 x 1 x 32 MB under 5 % of 2724 MB
    assert "128 MB in flight" in made["prefetch_factor"][1]


@pytest.mark.parametrize("overrides, variable", [
    ({"target_vram": 1.5}, "TARGET_VRAM"),
    ({"target_vram": 0.0}, "TARGET_VRAM"),
    ({"max_memory_mb": 0}, "MAX_MEMORY_MB"),
    ({"lr_scaling": "cubic"}, "LR_SCALING"),
    ({"effective_batch": 0}, "EFFECTIVE_BATCH"),
    ({"batch_size": 32, "effective_batch": 100}, "EFFECTIVE_BATCH"),
    ({"lr_reference_batch": -4}, "LR_REFERENCE_BATCH"),
])
def test_bad_values_name_the_variable(overrides, variable):
    with pytest.raises(UsageError) as err:
        config.resolve(None, overrides)
    assert variable in str(err.value) and "\n" not in str(err.value)
