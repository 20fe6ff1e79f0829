"""How much of the data every mode holds out for the validation loss: the last share of the
packed windows (pretraining), of the conversations (SFT) or of the pairs (preference training),
never trained on; held_out is the chat doors' one split (VAL_PATH or VAL_FRACTION)."""

from __future__ import annotations

import dataclasses
import math

MAX_AUTO_FRACTION = 0.1  # filling EVAL_BATCHES x VAL_ROWS never holds out more than this
# The held-out set is sized in rows of 8 (the baseline launcher's micro-batch), not BATCH_SIZE:
# runs that differ only in BATCH_SIZE (make compare, ./train_sft_custom.sh 16 vs 20) must train
# and validate on the same data.
VAL_ROWS = 8


def val_windows(n_windows: int, fraction: float, want: int) -> int:
    """How many of n_windows to hold out: ceil(fraction x n), raised towards `want` sequences
    (EVAL_BATCHES x VAL_ROWS) but never past MAX_AUTO_FRACTION of the data, and at least one."""
    if fraction <= 0 or n_windows < 2:
        return 0
    n_val = max(1, math.ceil(fraction * n_windows))
    if n_val < want:
        n_val = max(n_val, min(want, int(MAX_AUTO_FRACTION * n_windows)))
    return min(n_val, n_windows - 1)


def held_out_tail(n: int, fraction: float, eval_batches: int, unit: str, decide) -> int:
    """How many of the last of n examples (conversations, pairs) to hold out for VAL_FRACTION, the
    decision logged (and the raise towards EVAL_BATCHES x VAL_ROWS, when there is one); 0: none."""
    want = eval_batches * VAL_ROWS
    n_val = val_windows(n, fraction, want)
    if n_val == 0:
        return 0
    asked = math.ceil(fraction * n)
    if n_val > asked:  # a small set: a handful of examples gives a noisy validation loss
        decide("val_fraction", round(n_val / n, 4),
               f"VAL_FRACTION={fraction:g} holds out {asked} of {n} {unit}; raised towards EVAL_BATCHES x "
               f"{VAL_ROWS} = {want}, at most {MAX_AUTO_FRACTION:.0%} of the data")  # fmt: skip
    decide("validation", f"{n_val} {unit}", f"the last {n_val / n:.1%} of the data (VAL_FRACTION)")
    return n_val


def held_out(d, eval_batches: int, dataset, load, decide):
    """(train, validation) of a chat door's dataset: VAL_PATH's, read by load(the data config with VAL_PATH as
    DATA_PATH), or the last VAL_FRACTION of `dataset` (never trained on); validation None when VAL_FRACTION
    is 0. A dataset says its unit and gives part(lo, hi), a view."""
    from train.data import records
    from train.data.json_lines import record_limit

    if d.val_path is not None:
        with records.reading("VAL_PATH"), record_limit(d.max_record_mb):
            val = load(dataclasses.replace(d, data_path=d.val_path))
        decide("validation", f"{len(val)} {val.unit}", f"VAL_PATH={d.val_path}")
        return dataset, val
    n_val = held_out_tail(len(dataset), d.val_fraction, eval_batches, dataset.unit, decide)
    if n_val == 0:
        return dataset, None
    n = len(dataset) - n_val
    return dataset.part(0, n), dataset.part(n, len(dataset))
