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
from train.data.chat.packing import FLASH, VARLEN, PackedCollator, PackedRows, pack


class PairDataset(Dataset):
    """Encoded pairs (the preference cache's memory-mapped view, or a list of pair_encode's examples).
    sides: (pairs, 3) prompt / chosen / rejected tokens. lengths and source_lengths are the samplers'
    cost model (see the module doc); packed_lengths the tokens a pair takes in a packed row."""

    def __init__(self, examples, seq2seq: bool = False):
        self.examples, self.seq2seq = examples, seq2seq
        sides = getattr(examples, "sides", None)
        if sides is None:
            names = ("prompt_ids", "chosen_ids", "rejected_ids")
            sides = np.array([[len(e[n]) for n in names] for e in examples], dtype=np.int64).reshape(-1, 3)
        self.sides = np.asarray(sides, dtype=np.int64)
        prompt, longer = self.sides[:, 0], self.sides[:, 1:].max(axis=1)
        if seq2seq:  # a batch costs P x longest source + 2P x longest target
            self.source_lengths, self.lengths = prompt, prompt + 2 * longer
        else:  # 2P rows x the longest prompt + reply: "source" and "target" the same width
            self.source_lengths, self.lengths = prompt + longer, 2 * (prompt + longer)
        self.packed_lengths = 2 * prompt + self.sides[:, 1] + self.sides[:, 2]

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
            out[k * len(pairs) + i] = {"input_ids": prompt + list(pair[f"{side}_ids"]),
                                       "labels": [IGNORE_INDEX] * len(prompt) + list(pair[f"{side}_labels"])}  # fmt: skip
    return out


class PairCollator(PadCollator):
    """P causal pairs -> PadCollator's batch of 2P rows (chosen, then rejected) and n_pairs."""

    def __call__(self, pairs: Sequence[dict]) -> dict:
        return {**super().__call__(sequences(pairs)), "n_pairs": len(pairs)}


class Seq2SeqPairCollator(Seq2SeqCollator):
    """P encoder-decoder pairs -> input_ids / attention_mask (P, S), labels (2P, T); see the module doc.
    widths as PadCollator's (length buckets, each side bucketed on its own)."""

    def __call__(self, pairs: Sequence[dict]) -> dict:
        input_ids, attention_mask = self._pad([p["prompt_ids"] for p in pairs], self.pad_token_id)
        labels, _ = self._pad([p["chosen_labels"] for p in pairs] + [p["rejected_labels"] for p in pairs],
                              IGNORE_INDEX)  # fmt: skip
        real = sum(len(p["prompt_ids"]) + len(p["chosen_labels"]) + len(p["rejected_labels"]) for p in pairs)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels, "n_pairs": len(pairs),
                "n_real_tokens": real, "n_padded_tokens": input_ids.numel() + labels.numel()}  # fmt: skip


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


# A micro-batch's flat row where the kit sets widths (CUDA, COMPILE=1): a multiple of 8 for the tensor cores, at most
# 7 pad tokens. Not whole rows of MAX_LENGTH: 8 short pairs would fill a fifth of one (compiled, the row's length
# is dynamic from the first call, as the length buckets' are: one graph, see length_varies).
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
