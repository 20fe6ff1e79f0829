"""T5's span-corruption objective over the packed pretraining windows, so an encoder-decoder
pretrains on raw text (the built-in corpus included) as GPT-2 does.

Each sample is one raw window of the token cache (train/data/text.py PackedDataset, windows of
span_lengths(MAX_LENGTH)[0] tokens). 15 % of its tokens are noise, in spans of 3 on average
(random_spans_noise_mask, as T5's own): the source keeps the other tokens with one sentinel
(<extra_id_0>, <extra_id_1> ...) in place of each span, then end-of-text; the target is each
sentinel followed by the span it hides, then end-of-text. Every window has the same source
and target length (train/core/seq2seq.py corrupted_lengths); the batches are made by
train/data/chat/batching.py's Seq2SeqCollator, as for SFT's pairs (one batch contract).

The noise mask is drawn from SEED and the sample's index alone, never from a running RNG: a
resumed run, a worker process, another rank or another epoch sees exactly the same sample.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset, Subset

from train.core.seq2seq import MEAN_SPAN_LENGTH, NOISE_DENSITY

OBJECTIVE = "span_corruption"  # its name as a family's pretraining objective (train/models Family.objective)


def noise_counts(length: int) -> tuple[int, int]:
    """(noise tokens, noise spans) of a window: the rounding corrupted_lengths uses."""
    noise = max(1, min(length - 1, round(length * NOISE_DENSITY)))
    return noise, max(1, round(noise / MEAN_SPAN_LENGTH))


def _segment_lengths(items: int, segments: int, rng: np.random.Generator) -> np.ndarray:
    """`items` split into `segments` non-empty runs at random (T5's _random_segmentation)."""
    starts = np.zeros(items, dtype=bool)
    starts[rng.choice(np.arange(1, items), segments - 1, replace=False)] = True
    return np.bincount(np.cumsum(starts), minlength=segments)


def random_spans_noise_mask(length: int, rng: np.random.Generator) -> np.ndarray:
    """A boolean mask of `length` with noise_counts(length) noise tokens in that many spans:
    kept and noise runs alternate, starting with kept tokens and ending with noise (so the
    target needs no sentinel after its last span), as T5's random_spans_noise_mask."""
    noise, spans = noise_counts(length)
    noise_runs = _segment_lengths(noise, spans, rng)
    kept_runs = _segment_lengths(length - noise, spans, rng)
    runs = np.stack([kept_runs, noise_runs], axis=1).reshape(-1)
    return np.repeat(np.tile([False, True], spans), runs)


def corrupt(window: np.ndarray, mask: np.ndarray, sentinels, eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(source, target) of a window under a noise mask: each noise span becomes sentinels[k] in
    the source, and sentinels[k] + the span in the target; both end with end-of-text."""
    first = mask & ~np.concatenate([[False], mask[:-1]])  # the first token of each noise span
    span_of = np.cumsum(first) - 1
    ids = np.asarray(sentinels, dtype=np.int64)
    source = np.where(first, ids[span_of], window)[~mask | first]
    pairs = np.stack([ids[span_of], window], axis=1).reshape(-1)
    target = pairs[np.stack([first, mask], axis=1).reshape(-1)]  # (sentinel, token) at a span's start
    eos = np.array([eos_id], dtype=np.int64)
    return np.concatenate([source, eos]), np.concatenate([target, eos])


class SpanCorruptionDataset(Dataset):
    """Span-corrupted samples of a dataset of raw windows ({"input_ids": (L,)}): {"input_ids":
    the source, "labels": the target}, the batch contract's rows."""

    def __init__(self, windows: Dataset, sentinels: list[int], eos_id: int, seed: int):
        self.windows, self.sentinels, self.eos_id, self.seed = windows, list(sentinels), eos_id, seed

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> dict:
        window = self.windows[index]["input_ids"].numpy()
        rng = np.random.default_rng([self.seed, index])  # SEED and the index: the same sample on resume
        source, target = corrupt(
            window, random_spans_noise_mask(len(window), rng), self.sentinels, self.eos_id
        )
        return {"input_ids": torch.from_numpy(source), "labels": torch.from_numpy(target)}


def span_corrupted(dataset: Dataset | None, sentinels: list[int], eos_id: int, seed: int) -> Dataset | None:
    """A raw-window dataset (or the Subset split_pretraining made of one)
    corrupted; a Subset keeps its range, so the index (and the mask) is the window's own and a
    training and a held-out window never share a mask."""
    if dataset is None:
        return None
    if isinstance(dataset, Subset):
        return Subset(SpanCorruptionDataset(dataset.dataset, sentinels, eos_id, seed), dataset.indices)
    return SpanCorruptionDataset(dataset, sentinels, eos_id, seed)


def sentinels_needed(raw_window: int) -> int:
    """Sentinels a window of raw_window tokens uses: one per noise span."""
    return noise_counts(raw_window)[1]
