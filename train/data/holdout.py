"""How much of the data both modes hold out for the validation loss: the last share of the
packed windows (pretraining) or of the conversations (SFT), never trained on. Imports nothing
of the kit."""

from __future__ import annotations

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
