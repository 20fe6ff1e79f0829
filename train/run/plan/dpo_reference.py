"""Preference training's reference model, decided and made once in the plan: REFERENCE=copy (a frozen
copy of the policy on the device), precomputed (one pass of the policy as it starts over every pair,
its log-probs cached on disk and carried by each batch, so training holds one model), or adapters
(LoRA's base: the policy with its adapters off). The losses themselves are train/core/preference's.

The precomputed log-probs live in CACHE_DIR/pref_reference/<key>/, the key covering what changes them:
the reference model's weights (a digest of every tensor), the pairs (the preference cache's folder,
itself keyed by data, tokenizer, template, MAX_LENGTH and model kind, and the range of pairs), the
precision and the micro-batch of the pass. A second run of the same model on the same data reads them.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from train.core.files import writing
from train.core.preference import reference_over
from train.data.pref.pref_batching import PairCollator, PairDataset, Seq2SeqPairCollator
from train.data.sft.packing import PackedRows

PRECOMPUTED = ("ref_chosen_logps", "ref_rejected_logps")
PASS_BATCH = 8  # pairs per forward of the pass (fixed: the cached numbers do not depend on BATCH_SIZE)


class RefExamples:
    """Pairs with their reference log-probs: item i is pair i with ref_chosen_logps and
    ref_rejected_logps added (the samplers read `sides` as the pairs')."""

    def __init__(self, examples, chosen: np.ndarray, rejected: np.ndarray):
        self.examples, self.chosen, self.rejected = examples, chosen, rejected
        sides = getattr(examples, "sides", None)
        if sides is not None:
            self.sides = sides

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict:
        return {**self.examples[index], PRECOMPUTED[0]: float(self.chosen[index]),
                PRECOMPUTED[1]: float(self.rejected[index])}  # fmt: skip


class WithReference:
    """A preference collator whose batches also carry each pair's reference log-probs, in the batch's
    pair order (a packed row's pairs row by row, as PackedPairCollator numbers them). Its other
    attributes (length buckets, attention) are the collator's."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        if name == "inner":  # not set yet (unpickling)
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __setattr__(self, name, value):
        if name == "inner":
            object.__setattr__(self, name, value)
        else:
            setattr(self.inner, name, value)

    def __call__(self, items) -> dict:
        batch = self.inner(items)
        pairs = [p for item in items for p in (item if isinstance(item, list) else [item])]
        for key in PRECOMPUTED:
            batch[key] = torch.tensor([p[key] for p in pairs], dtype=torch.float32)
        return batch


def weights_digest(model) -> str:
    """sha256 of every tensor of the model (names, dtypes, shapes, bytes): the reference's identity."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def _pairs_key(dataset: PairDataset) -> str:
    """The pairs' identity: the preference cache's folder and range (a list of pairs: their ids)."""
    examples = dataset.examples
    folder = getattr(examples, "folder", None)
    if folder is not None:
        return f"{Path(folder).name}\0{examples.lo}\0{examples.hi}"
    return hashlib.sha256(repr([sorted(e.items()) for e in examples]).encode()).hexdigest()


def precompute(model, dataset: PairDataset, pad_id: int, device, precision: str, source_target: bool,
               cache_dir: Path, digest: str, say) -> RefExamples:
    """The pairs with their reference log-probs: read from the cache, or one pass of `model` (the
    reference: the policy before its first step), then written there."""
    key = hashlib.sha256(f"{digest}\0{_pairs_key(dataset)}\0{precision}\0{PASS_BATCH}".encode()).hexdigest()[:32]
    folder = Path(cache_dir) / "pref_reference" / key
    files = [folder / f"{side}.npy" for side in ("chosen", "rejected")]
    if all(f.is_file() for f in files):
        chosen, rejected = (np.load(f, allow_pickle=False) for f in files)
        if len(chosen) == len(rejected) == len(dataset):
            say(f"reference log-probs: reused {folder}")
            return RefExamples(dataset.examples, chosen, rejected)
    start = time.perf_counter()
    collate = (Seq2SeqPairCollator if dataset.seq2seq else PairCollator)(pad_id)
    batches = (collate([dataset[i] for i in range(lo, min(lo + PASS_BATCH, len(dataset)))])
               for lo in range(0, len(dataset), PASS_BATCH))  # fmt: skip
    chosen, rejected = reference_over(model, batches, device, precision, source_target=source_target)
    folder.mkdir(parents=True, exist_ok=True)
    for path, values in zip(files, (chosen, rejected), strict=True):
        with writing(path) as out:  # a fresh name, fsynced, renamed: a killed pass leaves no half file
            np.save(out, values)
    say(f"reference log-probs: {len(dataset)} pairs in {time.perf_counter() - start:.1f} s, cached in {folder} "
        "(reused by a run of the same model, data and precision)")
    return RefExamples(dataset.examples, chosen, rejected)


def with_precomputed(data, model, device, precision: str, source_target: bool, cache_dir: Path, say):
    """A new Data whose training and validation batches carry the reference log-probs
    (REFERENCE=precomputed); `data` is left as it was (its datasets and collators are shared, unchanged)."""
    digest = weights_digest(model)
    pad = data.tokenizer.pad_token_id
    pairs = data.conversations
    train = precompute(model, pairs, pad, device, precision, source_target, cache_dir, digest, say)
    if isinstance(data.dataset, PackedRows):
        dataset = PackedRows(train, data.dataset.rows)
    else:
        dataset = PairDataset(train, pairs.seq2seq)
    val_dataset, val_collate = data.val_dataset, data.val_collate
    if val_dataset is not None:
        val = precompute(model, val_dataset, pad, device, precision, source_target, cache_dir, digest, say)
        val_dataset, val_collate = PairDataset(val, val_dataset.seq2seq), WithReference(val_collate)
    return replace(data, dataset=dataset, val_dataset=val_dataset, collate=WithReference(data.collate),
                   val_collate=val_collate, summary=dict(data.summary))
