"""The one DataLoader factory, and what a mode's data front door hands back (Data).

Every DataLoader of the kit is made here, by `_data_loader`: the training one with the guides'
knobs (worker processes, prefetch, pinned memory on CUDA only: nothing to pin for elsewhere,
persistent workers) and its sampler chosen from the data config (a seeded epoch order for packed
windows and plain SFT, length-grouped or token-budget batches for SFT), and the validation one
(in order, in process). Callers hand in values (the data config, seed, device, rank), never the
Plan. Imports train/core and train/data only, never the root config.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.utils.data import DataLoader

from train.data.chat.batching import BudgetSampler, GroupedSampler
from train.data.text import EpochSampler


@dataclass
class Data:
    """What a mode's data front door hands the plan: the training set, the held-out set and how
    to batch them. summary: summary.json's entries about the data; conversations: SFT's training
    conversations before packing (their lengths are logged)."""

    tokenizer: object
    dataset: torch.utils.data.Dataset
    val_dataset: torch.utils.data.Dataset | None = None
    collate: Callable | None = None
    val_collate: Callable | None = None
    summary: dict = field(default_factory=dict)
    conversations: object = None


def _data_loader(
    dataset,
    device: torch.device,
    data_cfg=None,
    collate_fn=None,
    *,
    batch_size: int | None = None,
    sampler=None,
    batch_sampler=None,
) -> DataLoader:
    """data_cfg: the training knobs; batch_sampler: whole batches (sizes vary); else batch_size
    rows in sampler's order, the last partial batch dropped (every micro-batch the same size).
    No data_cfg: validation (see make_val_loader)."""
    if data_cfg is None:
        return DataLoader(dataset, batch_size=batch_size, shuffle=False, drop_last=False, num_workers=0,
                          pin_memory=device.type == "cuda", collate_fn=collate_fn)
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
    dataset,
    data_cfg,
    batch_size: int,
    seed: int,
    device: torch.device,
    collate_fn=None,
    rank: int = 0,
    world_size: int = 1,
    budget: int | None = None,
):
    """(loader, sampler) for training at a micro-batch: batches by TOKEN_BUDGET, length-grouped
    (LENGTH_GROUPING, not with PACKING), or batch_size rows in a seeded epoch order. Every rank
    builds the same epoch order (same seed) and reads its own share of it. budget: the samples
    the run trains (all ranks), so that length grouping trains the ones a plain order would."""
    share = dict(rank=rank, world_size=world_size)
    if getattr(data_cfg, "token_budget", None) is not None:
        sampler = BudgetSampler(dataset.lengths, data_cfg.token_budget, seed=seed,
                                source_lengths=getattr(dataset, "source_lengths", None), **share)
        return _data_loader(dataset, device, data_cfg, collate_fn, batch_sampler=sampler), sampler
    if getattr(data_cfg, "length_grouping", False) and not data_cfg.packing:
        sampler = GroupedSampler(dataset.lengths, batch_size, seed=seed, budget=budget, **share)
        return _data_loader(
            dataset, device, data_cfg, collate_fn, batch_size=batch_size, sampler=sampler
        ), sampler
    sampler = EpochSampler(len(dataset), seed, rank, world_size)
    return _data_loader(
        dataset, device, data_cfg, collate_fn, batch_size=batch_size, sampler=sampler
    ), sampler


def make_val_loader(dataset, batch_size: int, device: torch.device, collate_fn=None) -> DataLoader:
    """In order, no workers (a few batches from a memmap; starting workers per pass costs more),
    last partial batch kept: every pass sees the same sequences."""
    return _data_loader(dataset, device, None, collate_fn, batch_size=batch_size)
