"""Preference batches (train/data/chat/pair_batching.py): P pairs -> 2P rows, chosen first, exact ids and
labels for a small case (causal and seq2seq), and packed rows whose sequences never see each other: the
per-sequence log-probabilities of a packed batch (masked sdpa and the varlen path) equal each sequence
run alone through a tiny real GPT-2."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_model
from train.core.attention import VARLEN_SDPA, use_attention
from train.core.units import IGNORE_INDEX
from train.data.chat.packing import SDPA
from train.data.chat.pair_batching import (
    PackedPairCollator,
    PairCollator,
    PairDataset,
    Seq2SeqPairCollator,
    pack_pairs,
)
from train.models.family import ENCODER_DECODER

X = IGNORE_INDEX
PAIRS = [
    {"prompt_ids": [5, 6], "chosen_ids": [7, 8, 2], "chosen_labels": [7, 8, 2], "rejected_ids": [9, 2],
     "rejected_labels": [9, 2]},
    {"prompt_ids": [5, 6, 10], "chosen_ids": [11, 4, 12], "chosen_labels": [11, X, 12], "rejected_ids": [13],
     "rejected_labels": [13]},
]  # fmt: skip


def test_causal_pairs_become_chosen_rows_then_rejected_rows():
    batch = PairCollator(pad_token_id=0)(PAIRS)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 2, 0], [5, 6, 10, 11, 4, 12],
                                           [5, 6, 9, 2, 0, 0], [5, 6, 10, 13, 0, 0]]  # fmt: skip
    assert batch["labels"].tolist() == [[X, X, 7, 8, 2, X], [X, X, X, 11, X, 12], [X, X, 9, 2, X, X],
                                        [X, X, X, 13, X, X]]  # fmt: skip
    assert batch["attention_mask"].tolist() == [
        [1, 1, 1, 1, 1, 0],
        [1] * 6,
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0, 0],
    ]
    assert (batch["n_pairs"], batch["n_real_tokens"], batch["n_padded_tokens"]) == (2, 19, 24)


def test_seq2seq_pairs_read_the_source_once():
    batch = Seq2SeqPairCollator(pad_token_id=0)(PAIRS)
    assert batch["input_ids"].tolist() == [[5, 6, 0], [5, 6, 10]]
    assert batch["attention_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]
    assert batch["labels"].tolist() == [[7, 8, 2], [11, X, 12], [9, 2, X], [13, X, X]]
    assert (batch["n_pairs"], batch["n_real_tokens"], batch["n_padded_tokens"]) == (2, 14, 18)


def test_dataset_lengths_are_the_padded_cost_of_a_pair():
    causal, t5 = PairDataset(PAIRS), PairDataset(PAIRS, ENCODER_DECODER)
    assert causal.sides.tolist() == [[2, 3, 2], [3, 3, 1]]
    # 2 rows x (p + longer)
    assert causal.source_lengths.tolist() == [5, 6] and causal.lengths.tolist() == [10, 12]
    assert t5.source_lengths.tolist() == [2, 3] and t5.lengths.tolist() == [8, 9]  # source + 2 targets
    assert causal.packed_lengths.tolist() == [9, 10]


def _pairs(n: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        p, c, r = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in ((3, 12), (2, 14), (1, 10)))
        ids = [torch.randint(1, 400, (k,), generator=g).tolist() for k in (p, c, r)]
        # an untrained token inside a reply
        chosen_labels = [t if k % 5 else X for k, t in enumerate(ids[1], 1)]
        out.append({"prompt_ids": ids[0], "chosen_ids": ids[1], "chosen_labels": chosen_labels,
                    "rejected_ids": ids[2], "rejected_labels": ids[2]})  # fmt: skip
    return out


def _sequence_logps(
    logits: torch.Tensor, labels: torch.Tensor, sequence_ids: torch.Tensor, n: int
) -> torch.Tensor:
    """Per sequence: the sum of log p(label) over its trained tokens (transformers' shift by one)."""
    logp = -F.cross_entropy(
        logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=X, reduction="none"
    )
    seq = torch.where(labels[:, 1:].flatten() != X, sequence_ids[:, 1:].flatten(), n)
    return torch.zeros(n + 1).index_add(0, seq.clamp(min=0), logp)[:n]


@pytest.mark.parametrize("attention", [SDPA, VARLEN_SDPA])
def test_packed_pair_rows_never_cross_sequences(attention):
    torch.manual_seed(0)
    pairs = _pairs(7)
    rows, packing = pack_pairs(PairDataset(pairs), max_length=32)
    assert len(rows) < len(pairs) and all(
        sum(2 * len(p["prompt_ids"]) + len(p["chosen_ids"]) + len(p["rejected_ids"]) for p in rows[k]) <= 64
        for k in range(len(rows))
    )
    batch = PackedPairCollator(pad_token_id=0, attention=attention)([rows[k] for k in range(len(rows))])
    order = [p for k in range(len(rows)) for p in rows[k]]  # the pairs as the batch numbers them
    n = len(order)
    assert batch["n_pairs"] == n and batch["sequence_ids"].shape == batch["labels"].shape
    assert sorted(set(batch["sequence_ids"].flatten().tolist()) - {-1}) == list(range(2 * n))
    model = tiny_model().eval()
    if attention == VARLEN_SDPA:
        use_attention(model, VARLEN_SDPA)
    inputs = {k: v for k, v in batch.items() if torch.is_tensor(v) and k not in ("labels", "sequence_ids")}
    reference = tiny_model().eval()
    with torch.no_grad():
        packed = _sequence_logps(model(**inputs).logits, batch["labels"], batch["sequence_ids"], 2 * n)
        padded = PairCollator(pad_token_id=0)(order)  # the same pairs as 2P padded rows, alone each
        rows_ids = torch.arange(2 * n)[:, None].expand_as(padded["labels"])
        alone = _sequence_logps(
            reference(padded["input_ids"], attention_mask=padded["attention_mask"]).logits,
            padded["labels"],
            rows_ids,
            2 * n,
        )
    assert torch.allclose(packed, alone, atol=1e-4, rtol=0), (packed - alone).abs().max()
    # positions restart at every sequence: each starts at 0 where its sequence id changes
    seq, pos = batch["sequence_ids"], batch["position_ids"]
    starts = torch.ones_like(seq, dtype=torch.bool)
    starts[:, 1:] = seq[:, 1:] != seq[:, :-1]
    assert (pos[starts & (seq >= 0)] == 0).all()
