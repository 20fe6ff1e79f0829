"""SFT batching: pad each batch to its own longest example, and choose which examples share a
batch so the padding stays small: length grouping (LengthGroupedSampler) or a token budget per
batch (TokenBudgetBatchSampler). GroupedSampler and BudgetSampler are the loop's versions of
those two: with several processes each rank takes a disjoint share of the epoch's batches, and
set_position(epoch, start) puts all ranks back where a resumed run stopped.

An encoder-decoder's examples are (source, target) pairs: Seq2SeqCollator pads each side to its
own longest, the samplers order by source + target length, and a token budget counts both
padded sides (rows x (longest source + longest target)).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import Sampler

from train.core.units import IGNORE_INDEX
from train.data.text import epoch_order

BUCKETS = 8  # a CUDA graph recorded per width (COMPILE_MODE=reduce-overhead): few recordings, few pools
BUCKET_RATIO = 1.5  # each width at most 1.5x the one below: a row pads to at most 1.5x itself


def length_buckets(max_length: int, multiple: int = 8) -> tuple[int, ...]:
    """The padded widths a batch may take when shapes must repeat (COMPILE=1, or CUDA where
    the caching allocator reuses blocks of equal size): MAX_LENGTH and up to BUCKETS - 1 widths
    below it, each BUCKET_RATIO smaller, rounded up to a multiple of `multiple`."""
    widths, width = {max_length}, float(max_length)
    for _ in range(BUCKETS - 1):
        width /= BUCKET_RATIO
        widths.add(min(max_length, max(multiple, -(-int(width) // multiple) * multiple)))
    return tuple(sorted(widths))


def padded_width(longest: int, multiple: int = 1, widths: Sequence[int] | None = None) -> int:
    """The width a batch whose longest row is `longest` pads to: the smallest bucket that holds
    it (a row past the last bucket keeps its own width), or the next multiple of `multiple`."""
    if widths:
        return next((w for w in widths if w >= longest), longest)
    return -(-longest // multiple) * multiple



class _Padded:
    """What both padded collators share: pad_token_id, pad_to_multiple_of, and the widths bucket_lengths
    sets."""

    widths: tuple[int, ...] | None = None

    @property
    def length_varies(self) -> bool:
        """Padded to the length buckets: each batch's width is one of several (compiled: marked dynamic)."""
        return self.widths is not None

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int = 1):
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of


class PadCollator(_Padded):
    """Pads a batch to its own longest example, not to max_length: with SFT lengths that vary
    10x, padding everything to max_length spends most of the compute on pad tokens.

    Returns tensors input_ids, labels (-100 on padding), attention_mask, plus two ints for the
    loop's padding_efficiency = n_real_tokens / n_padded_tokens, where n_padded_tokens is the
    size of the padded batch (rows x width, real tokens included). Pop the two ints before
    calling the model. pad_to_multiple_of=8 suits tensor cores at a small padding cost; widths
    (length_buckets, set where shapes must repeat) replaces it with a fixed set of widths.
    """

    def __call__(self, examples: Sequence[dict]) -> dict:
        lengths = [len(e["input_ids"]) for e in examples]
        width = padded_width(max(lengths), self.pad_to_multiple_of, self.widths)
        input_ids = torch.full((len(examples), width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
        for row, (example, n) in enumerate(zip(examples, lengths, strict=True)):
            input_ids[row, :n] = torch.as_tensor(example["input_ids"], dtype=torch.long)
            labels[row, :n] = torch.as_tensor(example["labels"], dtype=torch.long)
            attention_mask[row, :n] = 1
        return {
            "input_ids": input_ids,
            "labels": labels,
            "attention_mask": attention_mask,
            "n_real_tokens": sum(lengths),
            "n_padded_tokens": len(examples) * width,
        }


class Seq2SeqCollator(_Padded):
    """An encoder-decoder's batch: input_ids (B, S) the sources padded to the longest source,
    attention_mask (B, S) 1 on real source tokens, labels (B, T) the targets, -100 on padding
    (the model shifts them right from its decoder start itself: no decoder_input_ids), plus the
    two host ints of PadCollator over both sides (padded = rows x (S + T)); widths as
    PadCollator's, each side bucketed on its own."""

    def _pad(self, rows: list, value: int) -> tuple[torch.Tensor, torch.Tensor]:
        width = padded_width(max(len(r) for r in rows), self.pad_to_multiple_of, self.widths)
        out = torch.full((len(rows), width), value, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            out[i, : len(row)] = torch.as_tensor(row, dtype=torch.long)
            mask[i, : len(row)] = 1
        return out, mask

    def sides(self, sources: list, targets: list) -> dict:
        """The batch of these sources (each side padded on its own; a preference batch's targets outnumber
        its sources two to one, Seq2SeqPairCollator)."""
        input_ids, attention_mask = self._pad(sources, self.pad_token_id)
        labels, _ = self._pad(targets, IGNORE_INDEX)
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "labels": labels,
            "n_real_tokens": sum(map(len, sources)) + sum(map(len, targets)),
            "n_padded_tokens": input_ids.numel() + labels.numel(),
        }

    def __call__(self, examples: Sequence[dict]) -> dict:
        return self.sides([e["input_ids"] for e in examples], [e["labels"] for e in examples])


def padded(layout) -> type:
    """The collator that pads a batch of the layout's examples: PadCollator, or Seq2SeqCollator for pairs."""
    return layout.pick(PadCollator, Seq2SeqCollator)


def padding_efficiency(lengths: Sequence[int], batches: Sequence[Sequence[int]]) -> float:
    """Real tokens / padded batch size over the given batches of indices (1.0 = no padding)."""
    lengths = np.asarray(lengths)
    real = sum(int(lengths[b].sum()) for b in batches)
    padded = sum(len(b) * int(lengths[b].max()) for b in batches)
    return real / padded if padded else 1.0


def _longest_first(batches: list[list[int]], lengths: np.ndarray) -> list[list[int]]:
    # The batch with the longest sample goes first, so an out-of-memory shows at step 1 rather
    # than an hour in (the same trick as transformers' length-grouped sampler).
    top = max(range(len(batches)), key=lambda k: int(lengths[batches[k]].max()))
    batches[0], batches[top] = batches[top], batches[0]
    return batches


class LengthGroupedSampler(Sampler[int]):
    """DataLoader(sampler=..., batch_size=batch_size): an order in which each run of batch_size
    indices has similar lengths, so PadCollator pads little, yet the epoch stays random.

    Take the epoch's seeded order (the plain sampler's), cut into mega-batches of
    mega_batch_mult x batch_size, sort each by length, split into batches, shuffle the batches.
    Deterministic for (seed, epoch); call set_epoch each epoch. The one short batch (if len %
    batch_size) stays last so batches never straddle. budget: the samples a run trains in all;
    an epoch it ends in groups the first ones of the order it reaches (rounded up to whole
    batches) among themselves and serves them first, so the run trains the same samples as a
    plain run with that budget, only batched differently (the same tokens, make compare-sft).
    """

    def __init__(self, lengths: Sequence[int], batch_size: int, seed: int = 0, epoch: int = 0,
                 mega_batch_mult: int = 50, budget: int | None = None):
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.batch_size, self.seed, self.epoch, self.mega_batch_mult = (
            batch_size,
            seed,
            epoch,
            mega_batch_mult,
        )
        self.budget = budget

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _head(self, n: int) -> int:
        """How many samples of this epoch's order the budget reaches (n: no budget ends here)."""
        if self.budget is None:
            return n
        left = self.budget - self.epoch * (n // self.batch_size * self.batch_size)
        return n if left <= 0 else min(n, -(-left // self.batch_size) * self.batch_size)

    def batches(self) -> list[list[int]]:
        n = len(self.lengths)
        if n == 0:
            return []
        rng = np.random.default_rng([self.seed, self.epoch])
        order = epoch_order(n, self.seed, self.epoch).numpy()
        head = self._head(n)
        out: list[list[int]] = []
        for part in (order[:head], order[head:]):
            batches = self._grouped(part)
            if not batches:
                continue
            tail = [batches.pop()] if len(batches[-1]) < self.batch_size else []
            rng.shuffle(batches)
            out += (_longest_first(batches, self.lengths) if batches else []) + tail
        return out

    def _grouped(self, order: np.ndarray) -> list[list[int]]:
        mega = self.batch_size * self.mega_batch_mult
        batches: list[list[int]] = []
        for lo in range(0, len(order), mega):
            chunk = order[lo : lo + mega]
            chunk = chunk[np.argsort(-self.lengths[chunk], kind="stable")]
            batches += [
                chunk[i : i + self.batch_size].tolist() for i in range(0, len(chunk), self.batch_size)
            ]
        return batches

    def __iter__(self) -> Iterator[int]:
        for batch in self.batches():
            yield from batch

    def __len__(self) -> int:
        return len(self.lengths)


class TokenBudgetBatchSampler(Sampler[list[int]]):
    """DataLoader(batch_sampler=...): batches sized by tokens, not samples. Each batch's padded
    size (rows x its longest sample) stays <= max_tokens, so short samples come many to a batch
    and long ones few, and memory per step stays flat. A single sample longer than the budget
    is a batch of its own. With shuffle=False the order is longest first and fixed (for eval).
    source_lengths (encoder-decoder pairs; lengths are then source + target): a batch's padded
    size is rows x (longest source + longest target), both sides padded on their own.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        max_tokens: int,
        seed: int = 0,
        epoch: int = 0,
        shuffle: bool = True,
        mega_batch_mult: int = 50,
        source_lengths: Sequence[int] | None = None,
    ):
        self.lengths = np.asarray(lengths, dtype=np.int64)
        # A causal example is all "source": its target side is 0 and the cost rows x longest.
        self.sources = self.lengths if source_lengths is None else np.asarray(source_lengths, dtype=np.int64)
        self.max_tokens, self.seed, self.epoch, self.shuffle = max_tokens, seed, epoch, shuffle
        self.mega_batch_mult = mega_batch_mult
        self._cache: tuple[int, list[list[int]]] | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _order(self, rng: np.random.Generator) -> np.ndarray:
        if not self.shuffle:
            return np.argsort(-self.lengths, kind="stable")
        order = rng.permutation(len(self.lengths))
        per_batch = max(1, self.max_tokens // max(1, int(self.lengths.mean())))
        mega = per_batch * self.mega_batch_mult
        chunks = [order[lo : lo + mega] for lo in range(0, len(order), mega)]
        return np.concatenate([c[np.argsort(-self.lengths[c], kind="stable")] for c in chunks])

    def batches(self) -> list[list[int]]:
        if self._cache is not None and self._cache[0] == self.epoch:
            return self._cache[1]
        rng = np.random.default_rng([self.seed, self.epoch])
        batches: list[list[int]] = []
        current: list[int] = []
        wide_source = wide_target = 0
        for i in self._order(rng).tolist() if len(self.lengths) else []:
            source, target = int(self.sources[i]), int(self.lengths[i] - self.sources[i])
            width = max(wide_source, source) + max(wide_target, target)
            if current and (len(current) + 1) * width > self.max_tokens:
                batches.append(current)
                current, wide_source, wide_target = [], 0, 0
            current.append(i)
            wide_source, wide_target = max(wide_source, source), max(wide_target, target)
        if current:
            batches.append(current)
        if self.shuffle and batches:
            rng.shuffle(batches)
            batches = _longest_first(batches, self.lengths)
        self._cache = (self.epoch, batches)
        return batches

    def __iter__(self) -> Iterator[list[int]]:
        yield from self.batches()

    def __len__(self) -> int:
        return len(self.batches())


def deal(batches: list[list[int]], rank: int, world_size: int) -> list[list[int]]:
    """This rank's batches: every world_size-th one from `rank`, the list first trimmed to a
    multiple of world_size so every rank gets as many batches as the others and none waits in
    a collective at an epoch's end for a batch another rank never gets. Rank 0 takes batch 0,
    the longest (_longest_first), so an out-of-memory still shows at step 1."""
    usable = len(batches) - len(batches) % world_size
    return batches[rank:usable:world_size]


class _Dealt:
    """What the loop's samplers add to their parents: this rank's place among world_size, and
    set_position(epoch, start) with start the global position (samples all ranks consumed)."""

    start = 0

    def __init__(self, lengths, size: int, seed: int = 0, rank: int = 0, world_size: int = 1, **more):
        super().__init__(lengths, size, seed=seed, **more)  # batch_size or max_tokens (, source_lengths)
        self.rank, self.world_size = rank, world_size

    def set_position(self, epoch: int, start: int = 0) -> None:
        self.set_epoch(epoch)
        self.start = start


class GroupedSampler(_Dealt, LengthGroupedSampler):
    """LengthGroupedSampler for the loop: this rank's share of each epoch's batches (dealt in
    turn by `deal`), and set_position(epoch, start) where start counts the samples all ranks
    together have consumed; each rank skips start // world_size of its own share."""


    def __iter__(self):
        # The short tail batch goes: on one process the loader drops it anyway (drop_last); dealt
        # to a rank mid-share it would shift every later batch of that rank by a few samples.
        full = [b for b in self.batches() if len(b) == self.batch_size]
        share = [i for batch in deal(full, self.rank, self.world_size) for i in batch]
        yield from share[self.start // self.world_size :]

    def __len__(self) -> int:
        share = len(self.lengths) // self.batch_size // self.world_size * self.batch_size
        return max(0, share - self.start // self.world_size)


class BudgetSampler(_Dealt, TokenBudgetBatchSampler):
    """TokenBudgetBatchSampler for the loop: batches dealt in turn like GroupedSampler's, so
    each optimizer micro-step is a round of world_size batches (one per rank). Batches vary in
    rows, so a global position is a row count at a round boundary: round_rows(position) says
    how far one round moves it, and set_position(epoch, start) skips whole rounds until the
    rows passed reach start."""


    def rounds(self) -> list[list[list[int]]]:
        """This epoch's rounds: world_size consecutive batches, the k-th for rank k."""
        batches, w = self.batches(), self.world_size
        return [batches[lo : lo + w] for lo in range(0, len(batches) - len(batches) % w, w)]

    def _bounds(self) -> np.ndarray:
        """Global positions at the round boundaries: 0, rows of round 0, of rounds 0-1, ..."""
        rows = [sum(len(b) for b in r) for r in self.rounds()]
        return np.concatenate([[0], np.cumsum(rows, dtype=np.int64)])

    def _first_round(self, position: int) -> int:
        # A round that began before `position` counts as consumed: ranks cannot split a round.
        return int(np.searchsorted(self._bounds()[:-1], position, side="left"))

    def round_rows(self, position: int) -> int:
        """Rows of the round that starts at `position` (all ranks together). Off a boundary
        (a position from another world size): the rows up to the end of the round
        set_position would yield first, so the count lands on a boundary again."""
        bounds = self._bounds()
        k = self._first_round(position)
        if k >= len(bounds) - 1:
            raise ValueError(f"position {position} is past the epoch's last round ({bounds[-1]} rows)")
        return int(bounds[k + 1]) - position

    def __iter__(self):
        for batches in self.rounds()[self._first_round(self.start) :]:
            yield batches[self.rank]

    def __len__(self) -> int:
        return len(self.rounds()) - self._first_round(self.start)


def bucket_lengths(compile_on: bool, device: torch.device, max_length: int, collate, val_collate, layout,
                   decide) -> None:
    """Pad SFT and DPO batches to a fixed set of widths where repeated shapes pay: COMPILE (one
    graph whose lengths are dynamic, and under CUDA graphs one recording per bucket) or CUDA (the
    caching allocator reuses blocks of the same sizes). Eager on a CPU gains nothing from
    repeated shapes: there each batch keeps its own width, since every pad token is work thrown
    away; so do validation batches on a CPU (evaluation runs the eager model)."""
    if not (compile_on or device.type == "cuda"):
        return
    widths = length_buckets(max_length)
    for c in (collate, val_collate if device.type == "cuda" else None):
        if c is not None:
            c.widths = widths
    why = ("COMPILE: one graph with dynamic lengths serves them all, a CUDA graph "
           "(COMPILE_MODE=reduce-overhead) "
           "is recorded per bucket" if compile_on else f"{device.type}: the allocator reuses equal sizes")
    sides = layout.pick("", "; each side (source, target) bucketed on its own")
    decide("length_buckets", ",".join(map(str, widths)),
           f"{why}; batches pad to the smallest of {len(widths)} widths, each <= {BUCKET_RATIO}x the one "
           f"below{sides}; a packed row pads to rows x MAX_LENGTH")
