"""Reward training's batches of prompts: the dataset is the prompts' indices, a batch their ids left-padded
(input_ids, attention_mask: what the meter counts) and their indices (index: what the objective's rollout
samples and the rewards read the columns of). The completions are made from these by the objective
(train/core/reward/objective.py), under the current weights, inside the step. Imports torch only."""

from __future__ import annotations

from dataclasses import dataclass

import torch


class PromptDataset(torch.utils.data.Dataset):
    """Prompt i is item i (its index); lengths: each prompt's tokens; completion_length: the tokens sampled
    after each at most (MAX_COMPLETION_LENGTH), so a row the step trains on is at most the longest prompt
    and these (the memory estimate's row: train/run/plan/adapt.py row_shape)."""

    def __init__(self, ids: list[list[int]], completion_length: int = 0):
        self.ids, self.completion_length = ids, completion_length
        self.lengths = torch.tensor([len(row) for row in ids])

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> int:
        return i


@dataclass(frozen=True)
class PromptCollate:
    """Indices -> {index, input_ids, attention_mask, n_real_tokens, n_padded_tokens}, prompts left-padded."""

    ids: list[list[int]]
    pad_id: int

    def __call__(self, items: list[int]) -> dict:
        rows = [self.ids[i] for i in items]
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for k, row in enumerate(rows):
            input_ids[k, width - len(row):] = torch.tensor(row, dtype=torch.long)
            mask[k, width - len(row):] = 1
        real = sum(len(r) for r in rows)
        return {
            "index": torch.tensor(items, dtype=torch.long),
            "input_ids": input_ids,
            "attention_mask": mask,
            "n_real_tokens": real,
            "n_padded_tokens": input_ids.numel(),
        }
