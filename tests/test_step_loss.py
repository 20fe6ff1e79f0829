"""The kit's own optimizer step is token-correct: GRADIENT_ACCUM micro-batches of uneven
length give the update of one batch holding all of them, on the chunked loss (a bare model)
and on transformers' loss (what DDP, FSDP2 and torch.compile use)."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from conftest import tiny_model
from train.core import step
from train.data.chat.batching import PadCollator
from train.models.family import CAUSAL_LM


def examples(seed: int, n: int) -> list[dict]:
    """Conversations of very different lengths, loss on the second half of each."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.choice([5, 9, 30, 60])
        ids = [rng.randrange(3, 500) for _ in range(length)]
        out.append({"input_ids": ids, "labels": [-100] * (length // 2) + ids[length // 2 :]})
    return out


def one_update(model, batches: list[dict]) -> tuple[torch.Tensor, float]:
    """Parameters after one SGD step of train_step over `batches` (the step's micro-batches)."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    loss, _, _ = step.train_step(
        model,
        optimizer,
        scaler,
        iter(batches),
        len(batches),
        0.0,
        torch.device("cpu"),
        "fp32",
        layout=CAUSAL_LM,
    )
    return torch.cat([p.detach().flatten() for p in model.parameters()]), loss.item()


@pytest.mark.parametrize("chunked", [True, False])
def test_accumulation_equals_one_big_batch_on_uneven_lengths(chunked, monkeypatch):
    if not chunked:
        monkeypatch.setattr(step, "chunkable", lambda model: False)
    model = tiny_model(seed=3)
    data = examples(0, 8)
    collate = PadCollator(pad_token_id=0)
    micro = [collate(data[i : i + 2]) for i in range(0, 8, 2)]  # 4 x 2, each padded to its own longest
    whole = [collate(data)]  # 1 x 8
    targets = [int((b["labels"][:, 1:] != -100).sum()) for b in micro]
    assert len(set(targets)) > 1, "the micro-batches must differ in target tokens"
    params_micro, loss_micro = one_update(model, micro)
    params_whole, loss_whole = one_update(model, whole)
    assert loss_micro == pytest.approx(loss_whole, rel=1e-5)
    torch.testing.assert_close(params_micro, params_whole, rtol=0, atol=2e-6)

    # the old rule, a mean of per-micro-batch means, is measurably another update
    means = sum(model(**{k: v for k, v in b.items() if torch.is_tensor(v)}).loss.item() for b in micro) / 4
    assert abs(means - loss_whole) > 1e-3


def test_both_loss_paths_agree():
    """The chunked loss and transformers' own give the same loss for the same batch."""
    model = tiny_model(seed=1)
    batch = PadCollator(pad_token_id=0)(examples(1, 4))
    assert step.chunkable(model)
    chunked = step.forward_loss(model, batch, torch.device("cpu"), "fp32", layout=CAUSAL_LM)
    plain = model(**{k: v for k, v in batch.items() if torch.is_tensor(v)}).loss
    assert chunked.item() == pytest.approx(plain.item(), rel=1e-5)
