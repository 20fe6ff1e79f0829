"""Preference training's reference model, decided and made once in the plan: REFERENCE=copy (a frozen
copy of the policy on the device), precomputed (one pass of the policy as it starts over every pair,
its log-probs cached on disk and carried by each batch, so training holds one model), or adapters
(LoRA's base: the policy with its adapters off). The losses themselves are train/core/preference's.

The precomputed log-probs live in CACHE_DIR/pref_reference/<key>/, the key covering what changes them:
the reference model's weights (a digest of every tensor), the pairs (the preference cache's folder,
itself keyed by data, tokenizer, template, MAX_LENGTH and model kind, and the range of pairs), the
precision and the micro-batch of the pass. A second run of the same model on the same data reads them.
The folder is sealed as the other caches of CACHE_DIR are (train/data/cache_files.py: written whole
into a temporary folder, meta.json last with each file's sha256, renamed): meta.json also records
what the key was made of, so a folder copied from another model's or other pairs' key is not
taken, and the numbers are checked finite once, with their sha256. A damaged, foreign or non-finite
cache is said in one line naming it, removed and made again; nothing unchecked is trained on.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from train.core.errors import UsageError
from train.core.preference import reference_over
from train.data import cache_files
from train.data.chat.packing import PackedRows
from train.data.chat.pair_batching import (
    MicroPackedPairCollator,
    PackedPairCollator,
    PairCollator,
    PairDataset,
    Seq2SeqPairCollator,
    padded_pairs,
)

PRECOMPUTED = ("ref_chosen_logps", "ref_rejected_logps")
PASS_BATCH = 8  # pairs per forward of the pass (fixed: the cached numbers do not depend on BATCH_SIZE)
VERSION = "2"  # 2: sealed (meta.json: each file's sha256 and the key's parts); 1: bare .npy files
FILES = ("chosen.bin", "rejected.bin")  # float32, one per pair, in the pairs' order


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


class CarriesReference:
    """Mixed into a preference collator (before it): its batches also carry each pair's reference
    log-probs as fields (PRECOMPUTED), in the batch's pair order (a packed row's pairs row by row, as
    PackedPairCollator numbers them), read from the items RefExamples gives."""

    def __call__(self, items) -> dict:
        batch = super().__call__(items)
        pairs = [p for item in items for p in (item if isinstance(item, list) else [item])]
        for key in PRECOMPUTED:
            batch[key] = torch.tensor([p[key] for p in pairs], dtype=torch.float32)
        return batch


class RefPairCollator(CarriesReference, PairCollator):
    """PairCollator's batches with the reference log-probs."""


class RefSeq2SeqPairCollator(CarriesReference, Seq2SeqPairCollator):
    """Seq2SeqPairCollator's batches with the reference log-probs."""


class RefPackedPairCollator(CarriesReference, PackedPairCollator):
    """PackedPairCollator's batches (PACKING=1) with the reference log-probs."""


class RefMicroPackedPairCollator(CarriesReference, MicroPackedPairCollator):
    """MicroPackedPairCollator's batches (each micro-batch packed) with the reference log-probs."""


CARRYING = {cls.__mro__[2]: cls for cls in (RefPairCollator, RefSeq2SeqPairCollator, RefPackedPairCollator,
                                             RefMicroPackedPairCollator)}  # fmt: skip


def carrying(collate):
    """A collator of the same kind and settings (padding, length buckets, attention: every field the
    data's front door set) whose batches carry the reference log-probs; `collate` is left as it was.
    The loop and the loader read it as the plain collator it is: no wrapper in between."""
    kind = CARRYING.get(type(collate))
    if kind is None:
        raise TypeError(f"REFERENCE=precomputed: no reference-carrying form of {type(collate).__name__}")
    made = object.__new__(kind)
    made.__dict__.update(vars(collate))
    return made


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


def _open(folder: Path, identity: dict, n: int):
    """((chosen, rejected), None) for a sound cache of these pairs and this reference; (None, what is
    wrong) for a damaged or foreign one; (None, None) for none."""
    if not folder.exists():
        return None, None
    read, why = cache_files.read_manifest(
        folder, "the reference log-probs", lambda raw: (raw["identity"], raw["sha256"]), lambda meta: FILES
    )
    if read is None:
        return None, why
    (made_for, sums), sizes = read
    if made_for != identity:
        differ = sorted(
            k for k in identity if not isinstance(made_for, dict) or made_for.get(k) != identity[k]
        )
        return None, (f"it was made for another {' and '.join(differ) or 'key'} than this run's (a copied "
                      f"folder?)")
    for name, size in sizes.items():
        if size != 4 * n:
            return None, f"{name} holds {size:,} bytes, {n} pairs need {4 * n:,}"

    def finite(name: str) -> str | None:  # read once, with the sha256: remembered after
        bad = int(np.count_nonzero(~np.isfinite(np.fromfile(folder / name, dtype=np.float32))))
        return f"{name} holds {bad} non-finite log-prob(s)" if bad else None

    damage = cache_files.verify_sums(folder, sums, FILES, finite)
    if damage:
        return None, damage
    return tuple(np.fromfile(folder / name, dtype=np.float32) for name in FILES), None


def _identity(digest: str, dataset: PairDataset, precision: str) -> dict:
    """What the cached numbers depend on: the key is its digest, meta.json holds it whole."""
    return {"version": VERSION, "reference model": digest, "pairs": _pairs_key(dataset).replace("\0", " "),
            "precision": precision, "pass batch": PASS_BATCH}


def _build(folder: Path, identity: dict, chosen: np.ndarray, rejected: np.ndarray) -> None:
    """The cache written whole (cache_files: a temporary folder, meta.json last with the sha256 of
    each file, fsynced, renamed); another process that finished it first wins."""
    cache_files.remove_abandoned(cache_files.cache_folder(folder.parent))
    with cache_files.building(
        "computing the reference log-probs", "the reference log-probs", folder
    ) as temps:
        tmp = cache_files.temp_folder(folder, temps)
        sums = {}
        for name, values in zip(FILES, (chosen, rejected), strict=True):
            with open(tmp / name, "wb") as handle:
                out = cache_files.Hashed(handle)
                out.write(np.ascontiguousarray(values, dtype=np.float32).tobytes())
            sums[name] = out.digest.hexdigest()
        cache_files.publish(tmp, folder, {"identity": identity, "sha256": sums, "pairs": len(chosen)}, temps,
                            lambda f: _open(f, identity, len(chosen))[0] is not None)  # fmt: skip


def precompute(model, dataset: PairDataset, pad_id: int, device, precision: str, layout,
               cache_dir: Path, digest: str, say) -> RefExamples:
    """The pairs with their reference log-probs: read from the cache when it is sound (module doc), or
    one pass of `model` (the reference: the policy before its first step), then sealed there."""
    identity = _identity(digest, dataset, precision)
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]
    root = Path(cache_dir) / "pref_reference"
    cache_files.refuse_link(root)
    folder = root / key
    cache_files.drop_link(folder, say)
    for name in [folder / "meta.json", *(folder / f for f in FILES)] if folder.is_dir() else []:
        cache_files.drop_link(name, say)
    found, damage = _open(folder, identity, len(dataset))
    if found is not None:
        say(f"reference log-probs: reused {folder}")
        return RefExamples(dataset.examples, *found)
    if damage:
        say(f"reference log-probs cache {folder} was damaged ({damage}); removed, computing it again")
        cache_files.remove(folder)
    start = time.perf_counter()
    collate = padded_pairs(dataset.layout)(pad_id)
    batches = (collate([dataset[i] for i in range(lo, min(lo + PASS_BATCH, len(dataset)))])
               for lo in range(0, len(dataset), PASS_BATCH))  # fmt: skip
    chosen, rejected = reference_over(model, batches, device, precision, layout=layout)
    bad = np.flatnonzero(~(np.isfinite(chosen) & np.isfinite(rejected)))
    if len(bad):
        raise UsageError(f"REFERENCE=precomputed: the reference model (MODEL_PATH's, before training) gives "
                         f"non-finite log-probs for {len(bad)} of {len(dataset)} pairs (the first: pair "
                         f"{bad[0]}) "
                         f"at PRECISION={precision}; nothing was cached (try PRECISION=fp32, or check "
                         f"MODEL_PATH)")
    _build(folder, identity, chosen, rejected)
    say(f"reference log-probs: {len(dataset)} pairs in {time.perf_counter() - start:.1f} s, cached in "
        f"{folder} (reused by a run of the same model, data and precision)")
    return RefExamples(dataset.examples, chosen, rejected)


def with_precomputed(data, model, device, precision: str, layout, cache_dir: Path, say):
    """A new Data whose training and validation batches carry the reference log-probs
    (REFERENCE=precomputed); `data` is left as it was (its datasets and collators are shared, unchanged)."""
    digest = weights_digest(model)
    pad = data.tokenizer.pad_token_id
    pairs = data.conversations
    train = precompute(model, pairs, pad, device, precision, layout, cache_dir, digest, say)
    if isinstance(data.dataset, PackedRows):
        dataset = PackedRows(train, data.dataset.rows)
    else:
        dataset = PairDataset(train, pairs.layout)
    val_dataset, val_collate = data.val_dataset, data.val_collate
    if val_dataset is not None:
        val = precompute(model, val_dataset, pad, device, precision, layout, cache_dir, digest, say)
        val_dataset, val_collate = PairDataset(val, val_dataset.layout), carrying(val_collate)
    return replace(data, dataset=dataset, val_dataset=val_dataset, collate=carrying(data.collate),
                   val_collate=val_collate, summary=dict(data.summary))
