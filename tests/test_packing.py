"""Packing: best-fit decreasing fills rows, and packed conversations never see each other."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_model
from train.core.errors import UsageError
from train.core.units import IGNORE_INDEX
from train.data.chat.batching import padding_efficiency
from train.data.chat.packing import (
    EAGER,
    FLASH,
    SDPA,
    VARLEN,
    PackedCollator,
    PackedRows,
    attention_for,
    block_causal_mask,
    pack,
)
from train.models.family import CAUSAL_LM


def test_bfd_packs_alpaca_like_lengths_tightly():
    lengths = np.random.default_rng(0).integers(20, 401, size=500)
    p = pack(lengths, 1024)
    assert sorted(i for row in p.rows for i in row) == list(range(500))  # every one, once
    assert all(lengths[row].sum() <= 1024 for row in p.rows)
    assert p.efficiency >= 0.95
    assert p.efficiency_longest >= p.efficiency
    # one conversation per row, padded to the longest in groups of 8, for scale
    order = np.argsort(-lengths)
    padded = padding_efficiency(lengths, [order[i : i + 8].tolist() for i in range(0, 500, 8)])
    assert p.efficiency > padded
    again = pack(lengths, 1024)
    assert again.rows == p.rows  # deterministic
    seeded, reseeded = pack(lengths, 1024, seed=1), pack(lengths, 1024, seed=1)
    assert seeded.rows == reseeded.rows and seeded.rows != p.rows
    assert len(seeded.rows) == len(p.rows)


def test_bfd_is_best_fit_and_refuses_overlong():
    # 6 goes into the row with 4 free after 6 (the tighter fit), not the one with 5 free.
    assert pack([6, 5, 4], 10).rows == [[0, 2], [1]]
    assert pack([], 8).rows == []
    with pytest.raises(UsageError, match="MAX_LENGTH=8: conversation 1 has 9 tokens"):
        pack([3, 9], 8)


def _conversation(rng: random.Random, n: int) -> dict:
    ids = [rng.randrange(512) for _ in range(n)]
    prompt = rng.choice([0, rng.randrange(1, n)])  # 0: the first token itself is trained
    return {"input_ids": ids, "labels": [IGNORE_INDEX] * prompt + ids[prompt:]}


def _token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """transformers' causal-LM shift: logits at t against label t+1, unreduced."""
    return F.cross_entropy(logits[:-1], labels[1:], ignore_index=IGNORE_INDEX, reduction="none")


def _packed_batch(attention=SDPA):
    rng = random.Random(0)
    examples = [_conversation(rng, n) for n in (23, 9, 31, 17, 12, 40, 5, 27)]
    p = pack([len(e["input_ids"]) for e in examples], 64)
    rows = PackedRows(examples, p.rows)
    batch = PackedCollator(pad_token_id=0, attention=attention)([rows[k] for k in range(len(rows))])
    return examples, p.rows, batch


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return tiny_model().eval()


def test_packed_conversations_match_each_run_alone(model):
    examples, rows, batch = _packed_batch()
    width = max(sum(len(examples[i]["input_ids"]) for i in row) for row in rows)
    assert len(rows) < len(examples) and batch["attention_mask"].shape == (len(rows), 1, width, width)
    assert batch["n_real_tokens"] == sum(len(e["input_ids"]) for e in examples) < batch["n_padded_tokens"]
    tensors = {k: batch[k] for k in ("input_ids", "position_ids", "attention_mask")}
    with torch.no_grad():
        out = model(**tensors, labels=batch["labels"])
        logits = out.logits
        total, count, trained_starts = 0.0, 0, 0
        for r, row in enumerate(rows):
            start = 0
            for i in row:
                ids = torch.tensor(examples[i]["input_ids"])
                labels = torch.tensor(examples[i]["labels"])
                n = len(ids)
                alone = model(ids[None]).logits[0]
                assert torch.allclose(logits[r, start : start + n], alone, atol=1e-5, rtol=0), (r, i)
                mine = _token_losses(alone, labels)
                packed = _token_losses(logits[r], batch["labels"][r])[start : start + n - 1]
                assert torch.allclose(packed, mine, atol=1e-5, rtol=0)
                if start > 0:  # the boundary: nothing of this conversation is predicted from the last one
                    assert batch["labels"][r, start] == IGNORE_INDEX
                    assert batch["position_ids"][r, start] == 0
                    trained_starts += examples[i]["labels"][0] != IGNORE_INDEX
                total += float(mine.sum())
                count += int((labels[1:] != IGNORE_INDEX).sum())
                start += n
    assert trained_starts > 0  # the boundary rule was exercised, not vacuous
    # the model's own loss on the packed batch is the token mean over all conversations
    assert out.loss.item() == pytest.approx(total / count, abs=1e-5)


def test_without_the_block_mask_conversations_leak(model):
    examples, rows, batch = _packed_batch()
    r = next(k for k, row in enumerate(rows) if len(row) > 1)
    first = len(examples[rows[r][0]]["input_ids"])
    n = len(examples[rows[r][1]]["input_ids"])
    with torch.no_grad():
        masked = model(batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits[r, first : first + n]
        # naive concatenation: one causal sequence, positions running on
        plain = model(batch["input_ids"]).logits[r, first : first + n]
        # restarting positions alone, with a plain causal mask given explicitly
        causal = block_causal_mask(torch.zeros_like(batch["position_ids"]))
        shared = model(batch["input_ids"], attention_mask=causal,
                       position_ids=batch["position_ids"]).logits[r, first : first + n]
    assert (plain - masked).abs().max() > 1e-2
    assert (shared - masked).abs().max() > 1e-2


def test_transformers_detects_packing_from_position_ids_alone(model):
    """transformers 5.x builds the same block mask itself from restarting position_ids when no
    2D/4D mask is given; the explicit mask does not depend on that."""
    _, _, batch = _packed_batch()
    with torch.no_grad():
        explicit = model(
            batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
        )
        implicit = model(batch["input_ids"], position_ids=batch["position_ids"])
    assert torch.allclose(explicit.logits, implicit.logits, atol=1e-5, rtol=0)


def test_eager_float_mask_gives_the_same_logits():
    torch.manual_seed(0)
    eager = tiny_model().eval()
    eager.set_attn_implementation(EAGER)
    sdpa_model = tiny_model().eval()
    _, _, bool_batch = _packed_batch(SDPA)
    _, _, float_batch = _packed_batch(EAGER)
    assert float_batch["attention_mask"].dtype == torch.float32
    with torch.no_grad():
        a = sdpa_model(bool_batch["input_ids"], attention_mask=bool_batch["attention_mask"],
                       position_ids=bool_batch["position_ids"]).logits
        b = eager(float_batch["input_ids"], attention_mask=float_batch["attention_mask"],
                  position_ids=float_batch["position_ids"]).logits
    # every position, the padding's too, finite and equal
    assert torch.isfinite(b).all() and torch.allclose(a, b, atol=1e-5, rtol=0)


def test_flash_form_flattens_without_padding(model):
    examples, rows, batch = _packed_batch(FLASH)
    n = sum(len(e["input_ids"]) for e in examples)
    assert batch["input_ids"].shape == (1, n) and "attention_mask" not in batch
    assert batch["n_real_tokens"] == batch["n_padded_tokens"] == n
    assert batch["n_conversations"] == len(examples)
    cu = batch["cu_seq_lens_q"].tolist()
    assert cu[0] == 0 and cu[-1] == n and len(cu) == len(examples) + 1
    lengths = [b - a for a, b in zip(cu, cu[1:], strict=False)]
    assert batch["max_length_q"] == max(lengths)
    order = [i for row in rows for i in row]
    assert lengths == [len(examples[i]["input_ids"]) for i in order]
    assert all(batch["labels"][0, a] == IGNORE_INDEX and batch["position_ids"][0, a] == 0 for a in cu[:-1])
    # The layout is right whatever the kernel: an sdpa model given the flat row and position_ids
    # alone (transformers then builds the block mask) computes each conversation as if alone.
    with torch.no_grad():
        flat = model(batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
        for i, a, b in zip(order, cu, cu[1:], strict=False):
            alone = model(torch.tensor([examples[i]["input_ids"]])).logits[0]
            assert torch.allclose(flat[a:b], alone, atol=1e-5, rtol=0)


def test_attention_for_names_the_path_and_why(model, monkeypatch):
    cpu = attention_for(model, "bf16")
    assert cpu.kind == VARLEN and "no (T x T) mask" in cpu.why and "CUDA" in cpu.why
    assert attention_for("cpu").kind == VARLEN
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "flash_attn" else real(name, *a)
    )
    # this machine has no GPU: a cuda device is only named, never touched
    flash = attention_for("cuda", "bf16")
    assert flash.kind == FLASH and "varlen" in flash.why
    fp32 = attention_for("cuda", "fp32")
    assert fp32.kind == VARLEN and "bf16/fp16" in fp32.why
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "flash_attn" else real(name, *a)
    )
    assert "not installed" in attention_for("cuda", "bf16").why


def test_forward_loss_hands_flash_its_varlen_lengths(model):
    """flash-attention's varlen row reaches the model with cu_seq_lens_q/k AND max_length_q/k
    (host ints): without all four, transformers rebuilds them from position_ids on the device,
    with a read back in every layer. The counters (n_real_tokens ...) stay behind."""
    from train.core.step import forward_loss

    _, _, batch = _packed_batch(FLASH)
    seen = {}
    # the base model: the kit's chunked loss calls it, not the LM head's forward
    hook = model.base_model.register_forward_pre_hook(
        lambda mod, args, kwargs: seen.update(kwargs), with_kwargs=True
    )
    try:
        with torch.no_grad():
            loss = forward_loss(model, dict(batch), torch.device("cpu"), "fp32", layout=CAUSAL_LM)
    finally:
        hook.remove()
    assert torch.isfinite(loss)
    assert seen["max_length_q"] == seen["max_length_k"] == batch["max_length_q"]
    assert {"cu_seq_lens_q", "cu_seq_lens_k"} <= seen.keys() and "n_real_tokens" not in seen
