"""The one place a training DataLoader is made, with the guides' knobs: worker processes,
prefetch, pinned memory (on CUDA only: nothing to pin for elsewhere) and persistent workers.
Pretraining's packed windows come in EpochSampler's order (make_loader); SFT hands in its own
sampler (length-grouped) or batch sampler (token budget)."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from train.data.text import EpochSampler


def training_loader(
    dataset, data_cfg, device: torch.device, collate_fn=None, *, batch_size: int | None = None,
    sampler=None, batch_sampler=None,
) -> DataLoader:
    """batch_sampler: whole batches (sizes vary); else batch_size rows in sampler's order, the
    last partial batch dropped (every micro-batch the same size)."""
    knobs = dict(
        num_workers=data_cfg.num_workers,
        prefetch_factor=data_cfg.prefetch_factor,
        pin_memory=data_cfg.pin_memory and device.type == "cuda",
        persistent_workers=data_cfg.persistent_workers,
        collate_fn=collate_fn,
    )
    if batch_sampler is not None:
        return DataLoader(dataset, batch_sampler=batch_sampler, **knobs)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True, **knobs)


def make_loader(
    dataset, data_cfg, batch_size: int, seed: int, device: torch.device, collate_fn=None, rank: int = 0, world_size: int = 1
):
    """(loader, sampler): batch_size rows in a seeded epoch order, this rank's share of it."""
    sampler = EpochSampler(len(dataset), seed, rank, world_size)
    return training_loader(dataset, data_cfg, device, collate_fn, batch_size=batch_size, sampler=sampler), sampler
