"""Encoder-decoder shapes shared by the data (train/data/span_corruption.py builds the samples)
and the measuring tools (memory estimate, FLOPs): how long a T5 span-corruption sample's source
and target are for a given MAX_LENGTH. T5's own numbers: 15 % of the tokens are noise, in spans
of 3 on average; each span becomes one sentinel in the source and sentinel + span in the target.
"""

from __future__ import annotations

NOISE_DENSITY = 0.15
MEAN_SPAN_LENGTH = 3.0


def corrupted_lengths(raw_length: int) -> tuple[int, int]:
    """(source, target) lengths of a span-corrupted window of raw_length tokens: the source keeps
    the non-noise tokens, one sentinel per span and end-of-text; the target holds the noise
    tokens, one sentinel per span and end-of-text."""
    noise = max(1, min(raw_length - 1, round(raw_length * NOISE_DENSITY)))
    spans = max(1, round(noise / MEAN_SPAN_LENGTH))
    return raw_length - noise + spans + 1, noise + spans + 1


def span_lengths(max_length: int) -> tuple[int, int]:
    """(raw window, target length) for sources of at most max_length tokens: the longest raw
    window whose corrupted source fits (T5's compute_input_and_target_lengths). 512 -> (568, 114)."""
    raw = max_length
    while corrupted_lengths(raw + 1)[0] <= max_length:
        raw += 1
    while raw > 2 and corrupted_lengths(raw)[0] > max_length:
        raw -= 1
    return raw, corrupted_lengths(raw)[1]
