"""What a mode means to the parts that run before its objective exists (the plan's memory estimate,
fill and adapt, find-batch's and autotune's words) or without one (compare reads a run's summary.json):
one row per mode, beside the objectives (train/core/objective.py). The shared parts look a mode up
here and read the row's facts; none of them compares a mode's name. A new mode is a new row.
The objective's class is named, imported where its facts are read: compare reads summary.json
without torch.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Mode:
    """One mode's row: its objective's class, and what differs between modes that share one."""

    objective: str
    """The step's objective class (train/core/objective.py Objective), as module:Class: rows_per_sample, unit."""
    throughput: str = "samples_per_sec"
    """compare's headline figure: tokens_per_sec where samples vary in length (SFT's conversations: a
    side of single conversations and one of grouped batches count samples very differently)."""
    span_targets: bool = False
    """An encoder-decoder's targets are span corruption's (raw text), not a MAX_LENGTH bound."""
    fills_causal: bool = True
    """No BATCH_SIZE of the user's: a causal model's micro-batch fills the GPU too (an encoder-decoder's
    always does). Pretraining's packed windows keep the preset: compute-bound (find-batch measures)."""
    row_lengths: bool = False
    """The dataset's lengths are its rows' (the estimate reads the longest padded row); else the mode's
    bound (a pair's lengths are the samplers' cost, not a row)."""
    reference: bool = False
    """Compares with a reference model that REFERENCE picks after the micro-batch (fill leaves room for a copy)."""

    @property
    def objective_class(self) -> type:
        module, name = self.objective.split(":")
        return getattr(importlib.import_module(module), name)

    @property
    def rows_per_sample(self) -> int:
        return self.objective_class.rows_per_sample

    @property
    def unit(self) -> str:
        return self.objective_class.unit


TOKEN, PREFERENCE = "train.core.step:TokenObjective", "train.core.preference.loss:PreferenceObjective"
MODES = {
    "pretrain": Mode(TOKEN, span_targets=True, fills_causal=False),
    "sft": Mode(TOKEN, throughput="tokens_per_sec", row_lengths=True),
    "dpo": Mode(PREFERENCE, reference=True),
}


def mode_of(name: str) -> Mode:
    """A mode's row (config.py's mode names: pretrain, sft, dpo)."""
    return MODES[name]
