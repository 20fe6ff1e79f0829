"""Preference batches: P pairs -> one batch of 2P sequences, chosen first (rows 0..P-1), then rejected
(rows P..2P-1): rows i and P + i are pair i, so the loss scores chosen and rejected in one forward.

- PairCollator (causal): row i is prompt_i + chosen_i, row P + i is prompt_i + rejected_i, through SFT's
  PadCollator: input_ids, attention_mask, labels (-100 on the prompt, the untrained turns and padding),
  each batch padded to its own longest row (or a length bucket), plus n_real_tokens / n_padded_tokens.
- Seq2SeqPairCollator (encoder-decoder): the source once per pair, input_ids and attention_mask of P rows;
  labels of 2P rows, the chosen targets then the rejected ones (-100 on padding). The loss code runs the
  encoder on the P sources and the decoder on its output repeated twice (torch.cat([h, h])).
- PackedPairCollator (causal, PACKING=1): rows of pairs (pack_pairs: both sequences of a pair in one
  row of up to 2 x MAX_LENGTH tokens) through SFT's PackedCollator, so position_ids restart at every
  sequence and attention never crosses one (varlen: no (T x T) mask); sequence_ids (the shape of
  labels) names each token's sequence in the 2P order above, -1 on padding, for the per-sequence sums.
- MicroPackedPairCollator (causal, DPO's default): a micro-batch of P pairs, as the padded run's sampler
  draws them, in one unpadded row (varlen) or a row per pair (a masked model): the padded batch's
  pairs without its padding, so the same seed gives the same steps and losses (to float rounding).

PairDataset gives the SFT samplers (length grouping, TOKEN_BUDGET) lengths whose cost model is the
padded batch: rows x (prompt + longer reply) for a causal pair, one source plus two targets for a
seq2seq one, through the samplers' (source, target) form.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from train.core.units import IGNORE_INDEX
from train.data.chat.batching import PadCollator, Seq2SeqCollator
from train.data.chat.packing import FLASH, VARLEN, PackedCollator, PackedRows, pack, packed_attention
from train.models.family import CAUSAL_LM


class PairDataset(Dataset):
    """Encoded pairs (the preference cache's memory-mapped view, or a list of pair_encode's examples).
    sides: (pairs, 3) prompt / chosen / rejected tokens. lengths and source_lengths are the samplers'
    cost model (see the module doc); packed_lengths the tokens a pair takes in a packed row."""

    unit = "pairs"
    budget_note = ""  # the lengths are the padded cost already

    def __init__(self, examples, layout=CAUSAL_LM):
        self.examples, self.layout = examples, layout
        sides = getattr(examples, "sides", None)
        if sides is None:
            names = ("prompt_ids", "chosen_ids", "rejected_ids")
            sides = np.array([[len(e[n]) for n in names] for e in examples], dtype=np.int64).reshape(-1, 3)
        self.sides = np.asarray(sides, dtype=np.int64)
        prompt, longer = self.sides[:, 0], self.sides[:, 1:].max(axis=1)
        # causal: 2P rows x the longest prompt + reply ("source" and "target" the same width); an
        # encoder-decoder's batch costs P x longest source + 2P x longest target
        self.source_lengths = layout.pick(prompt + longer, prompt)
        self.lengths = layout.pick(2 * (prompt + longer), prompt + 2 * longer)
        self.packed_lengths = 2 * prompt + self.sides[:, 1] + self.sides[:, 2]

    def part(self, lo: int, hi: int) -> PairDataset:
        """Pairs lo..hi, a view (the held-out split)."""
        return PairDataset(self.examples[lo:hi], self.layout)

    def side_lengths(self) -> dict:
        """Each side's lengths in tokens, for the log."""
        return dict(zip(("prompt", "chosen", "rejected"), self.sides.T, strict=True))

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict:
        return self.examples[index]


def sequences(pairs: Sequence[dict]) -> list[dict]:
    """The 2P causal sequences of P pairs, chosen first: {"input_ids", "labels"} each."""
    out = [None] * (2 * len(pairs))
    for i, pair in enumerate(pairs):
        for k, side in enumerate(("chosen", "rejected")):
            prompt = list(pair["prompt_ids"])
            out[k * len(pairs) + i] = {
                "input_ids": prompt + list(pair[f"{side}_ids"]),
                "labels": [IGNORE_INDEX] * len(prompt) + list(pair[f"{side}_labels"]),
            }
    return out


class PairCollator(PadCollator):
    """P causal pairs -> PadCollator's batch of 2P rows (chosen, then rejected) and n_pairs."""

    def __call__(self, pairs: Sequence[dict]) -> dict:
        return {**super().__call__(sequences(pairs)), "n_pairs": len(pairs)}


class Seq2SeqPairCollator(Seq2SeqCollator):
    """P encoder-decoder pairs -> input_ids / attention_mask (P, S), labels (2P, T); see the module doc.
    widths as PadCollator's (length buckets, each side bucketed on its own)."""

    def __call__(self, pairs: Sequence[dict]) -> dict:
        targets = [p["chosen_labels"] for p in pairs] + [p["rejected_labels"] for p in pairs]
        return {**self.sides([p["prompt_ids"] for p in pairs], targets), "n_pairs": len(pairs)}


def padded_pairs(layout) -> type:
    """The collator that pads a batch of the layout's pairs: PairCollator, or Seq2SeqPairCollator."""
    return layout.pick(PairCollator, Seq2SeqPairCollator)


def pack_pairs(dataset: PairDataset, max_length: int):
    """(PackedRows of pairs, the Packing): best-fit decreasing into rows of 2 x max_length tokens, so a
    row holds at least one whole pair (its two sequences side by side)."""
    packing = pack(dataset.packed_lengths, 2 * max_length)
    return PackedRows(dataset.examples, packing.rows), packing


class PackedPairCollator(PackedCollator):
    """Rows of pairs (pack_pairs) -> PackedCollator's batch of their sequences (each pair's chosen then
    rejected, row by row), sequence_ids for the 2P order (chosen i -> i, rejected i -> P + i, padding
    -1) and n_pairs. A row's sequences never attend to each other (PackedCollator)."""

    def __call__(self, rows: Sequence[Sequence[dict]]) -> dict:
        batch = super().__call__([[s for pair in row for s in sequences([pair])] for row in rows])
        n_pairs = sum(len(row) for row in rows)
        ids = torch.full(batch["labels"].shape, -1, dtype=torch.long)
        flat = self.attention in (FLASH, VARLEN)  # one row of every sequence; else a row per row of pairs
        j = line = at = 0
        for row in rows:
            for pair in row:
                for seq, side in ((j, "chosen"), (n_pairs + j, "rejected")):
                    n = len(pair["prompt_ids"]) + len(pair[f"{side}_ids"])
                    ids[line, at : at + n] = seq
                    at += n
                j += 1
            if not flat:
                line, at = line + 1, 0
        return {**batch, "sequence_ids": ids, "n_pairs": n_pairs}


# A micro-batch's flat row where the kit sets widths (CUDA, COMPILE=1): a multiple of 8 for the tensor cores,
# at most 7 pad tokens. Not whole rows of MAX_LENGTH: 8 short pairs would fill a fifth of one (compiled, the
# row's length is dynamic from the first call, as the length buckets' are: one graph, see length_varies).
FLAT_MULTIPLE = 8


class MicroPackedPairCollator(PackedPairCollator):
    """P pairs (a padded run's micro-batch, not PACKING=1's rows) -> PackedPairCollator's batch of their 2P
    sequences in pair order: one flat row where the attention is varlen (its length rounded up to
    FLAT_MULTIPLE where the kit sets widths: on CUDA or under COMPILE=1), else a row per pair (a block
    mask per row)."""

    @property
    def length_varies(self) -> bool:
        """Every micro-batch's row has its own length: compiled, marked dynamic from the first call."""
        return True

    def __call__(self, pairs: Sequence[dict]) -> dict:
        rows = [list(pairs)] if self.attention in (FLASH, VARLEN) else [[p] for p in pairs]
        return super().__call__(rows)

    def flat_total(self, real: int, rows: int) -> int:
        if self.widths and self.attention == VARLEN:
            return -(-real // FLAT_MULTIPLE) * FLAT_MULTIPLE
        return real


def pair_batches(d, dataset: PairDataset, padded, set_attention, tok, device, precision: str, max_length: int,
                 decide) -> tuple:
    """(train rows, collator, summary entries) as PACKING says: 1, the pairs packed best-fit decreasing into
    rows of 2 x MAX_LENGTH tokens (a pair's two sequences in one row); empty, a causal model's micro-batches
    of pairs each in one unpadded row (the padded run's sampler, BATCH_SIZE pairs, the same pairs per step:
    its losses), an encoder-decoder's `padded`; 0, `padded`."""
    if d.packing is not None and not d.packing:
        return dataset, padded, {}
    batches = dataset.layout.pick(causal_pair_batches, seq2seq_pair_batches)
    return batches(d, dataset, padded, set_attention, tok, device, precision, max_length, decide)


def seq2seq_pair_batches(d, dataset: PairDataset, padded, set_attention, tok, device, precision: str,
                         max_length: int, decide) -> tuple:
    """An encoder-decoder's pairs, PACKING empty (PACKING=1 was refused before any data): `padded`."""
    decide("packing", 0, "PACKING empty: an encoder-decoder's pairs are padded (its source is read once "
           "per pair); LENGTH_GROUPING=1 or TOKEN_BUDGET trims their padding")
    return dataset, padded, {}


def causal_pair_batches(d, dataset: PairDataset, padded, set_attention, tok, device, precision: str,
                        max_length: int, decide) -> tuple:
    """A causal LM's pairs, PACKING 1 or empty: packed into rows, or each micro-batch in one unpadded row."""
    multiple = 8 if device.type == "cuda" else 1
    attention = packed_attention(device, precision, set_attention)
    if d.packing:
        if d.length_grouping:
            d.length_grouping = False
            decide("length_grouping", 0, "PACKING=1 groups pairs by length itself")
        rows, packing = pack_pairs(dataset, max_length)
        decide("packing", f"{len(rows)} rows",
               f"{len(dataset)} pairs best-fit into rows of 2 x MAX_LENGTH = {2 * max_length} tokens (a "
               f"pair's chosen and rejected sequences share a row): {packing.efficiency:.1%} of the row "
               f"tokens are real; BATCH_SIZE counts rows")  # fmt: skip
        decide("attention", attention.kind, attention.why)
        collate = PackedPairCollator(tok.pad_token_id, attention=attention.kind, pad_to_multiple_of=multiple)
        return rows, collate, {"packed_rows": len(rows), "packing_efficiency": packing.efficiency,
                               "attention": attention.kind}  # fmt: skip
    flat = attention.kind in (FLASH, VARLEN)
    decide("packing", "micro-batch",
           f"PACKING empty: each micro-batch's BATCH_SIZE pairs (as the padded run draws them) "
           f"{'laid end to end in one row' if flat else 'one pair per row'} instead of 2 x BATCH_SIZE rows "
           "padded to the longest: the same pairs per step, so the same losses, without the pad tokens "
           "(padding efficiency in summary.json); PACKING=0 pads, PACKING=1 packs all pairs into rows of "
           "2 x MAX_LENGTH")
    decide("attention", attention.kind, attention.why)
    collate = MicroPackedPairCollator(tok.pad_token_id, attention=attention.kind, pad_to_multiple_of=multiple)
    return dataset, collate, {"packing": "micro-batch", "attention": attention.kind}
