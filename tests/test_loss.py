"""Chunked cross-entropy equals the plain loss; token-correct accumulation equals one big batch."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_model
from train.core.loss import (
    chunked_cross_entropy,
    count_targets,
    lm_hidden_and_head,
    shift_targets,
    step_targets,
    token_mean_share,
)
from train.core.units import IGNORE_INDEX
from train.data.chat.batching import PadCollator


def _plain_sum(hidden, weight, labels):
    logits = (hidden @ weight.T).float()
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, weight.shape[0]), labels[:, 1:].reshape(-1),
        ignore_index=IGNORE_INDEX, reduction="sum",
    )


def _random_case(seed=0, b=3, t=37, h=16, v=101):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, h, generator=g, requires_grad=True)
    weight = torch.randn(v, h, generator=g, requires_grad=True)
    labels = torch.randint(0, v, (b, t), generator=g)
    labels[torch.rand(b, t, generator=g) < 0.4] = IGNORE_INDEX
    return hidden, weight, labels


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_chunked_equals_plain_loss_and_gradients(chunk):
    hidden, weight, labels = _random_case()
    total, count = chunked_cross_entropy(hidden, weight, labels, chunk_tokens=chunk)
    gh, gw = torch.autograd.grad(total, (hidden, weight))
    plain = _plain_sum(hidden, weight, labels)
    ph, pw = torch.autograd.grad(plain, (hidden, weight))
    assert count.item() == int((labels[:, 1:] != IGNORE_INDEX).sum()) == count_targets({"labels": labels})
    assert total.item() == pytest.approx(plain.item(), abs=1e-5 * max(1.0, plain.item()), rel=1e-6)
    assert torch.allclose(gh, ph, atol=1e-5, rtol=0)
    assert torch.allclose(gw, pw, atol=1e-5, rtol=0)


def test_chunked_scaled_backward_and_no_grad():
    hidden, weight, labels = _random_case(seed=1)
    total, _ = chunked_cross_entropy(hidden, weight, labels, chunk_tokens=10)
    (0.25 * total).backward()
    ph, pw = torch.autograd.grad(0.25 * _plain_sum(hidden, weight, labels), (hidden, weight))
    assert torch.allclose(hidden.grad, ph, atol=1e-6) and torch.allclose(weight.grad, pw, atol=1e-6)
    with torch.no_grad():
        again, _ = chunked_cross_entropy(hidden, weight, labels, chunk_tokens=10)
    assert again.item() == pytest.approx(total.item(), rel=1e-6) and again.grad_fn is None


def test_chunked_backward_keeps_no_logits():
    """What autograd saves for backward: nothing of the (tokens x vocab) size."""
    hidden, weight, labels = _random_case(b=4, t=64, h=8, v=512)
    saved = []

    def keep(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        chunked_cross_entropy(hidden, weight, labels, chunk_tokens=16)
    logits_size = 4 * 63 * 512  # the shifted logits: 63 predicting positions per row
    assert saved and max(saved) <= max(hidden.numel(), weight.numel()) < logits_size
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        _plain_sum(hidden, weight, labels)
    assert max(saved) >= logits_size  # the plain loss does keep them (so this check can fail)


def test_chunked_under_bf16_autocast_matches_the_plain_head():
    hidden, weight, labels = _random_case(seed=2, h=32, v=64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        total, _ = chunked_cross_entropy(hidden, weight, labels, chunk_tokens=9)
        plain = F.cross_entropy(
            F.linear(hidden, weight)[:, :-1].float().reshape(-1, 64), labels[:, 1:].reshape(-1),
            ignore_index=IGNORE_INDEX, reduction="sum",
        )
    gh, gw = torch.autograd.grad(total, (hidden, weight))
    ph, pw = torch.autograd.grad(plain, (hidden, weight))
    assert total.dtype == torch.float32 and gh.dtype == gw.dtype == torch.float32
    assert total.item() == pytest.approx(plain.item(), rel=2e-3)
    assert torch.allclose(gh, ph, atol=5e-2, rtol=5e-2) and torch.allclose(gw, pw, atol=5e-2, rtol=5e-2)


def _conversations(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(4, 60)
        ids = [rng.randrange(512) for _ in range(length)]
        prompt = rng.randint(1, length - 1)
        out.append({"input_ids": ids, "labels": [IGNORE_INDEX] * prompt + ids[prompt:]})
    return out


def _grads(model) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def test_model_shift_matches_transformers_loss():
    model = tiny_model().eval()
    batch = PadCollator(0)(_conversations(4, seed=3))
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with torch.no_grad():
        expected = model(**inputs, labels=batch["labels"]).loss
        hidden, weight = lm_hidden_and_head(model, **inputs)
        total, count = chunked_cross_entropy(hidden, weight, batch["labels"], chunk_tokens=13)
    assert weight is model.transformer.wte.weight  # GPT-2 ties the head to the embeddings
    assert (total / count).item() == pytest.approx(expected.item(), abs=1e-6)


def test_accumulation_is_token_correct():
    """4 micro-batches of 2 uneven conversations give the gradient of one batch of 8."""
    torch.manual_seed(0)
    model = tiny_model().eval()
    examples = _conversations(8, seed=5)
    collate = PadCollator(0)
    micro = [collate(examples[i : i + 2]) for i in range(0, 8, 2)]
    counts = [count_targets(b) for b in micro]
    assert len(set(counts)) > 1  # uneven, or the token mean and the mean of means would agree
    total = step_targets(micro)

    def loss_of(batch):
        hidden, weight = lm_hidden_and_head(
            model, input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        )
        return chunked_cross_entropy(hidden, weight, batch["labels"], chunk_tokens=17)

    model.zero_grad()
    step_loss = 0.0
    for batch in micro:
        share = token_mean_share(loss_of(batch)[0], total)
        share.backward()
        step_loss += share.item()
    accumulated = _grads(model).clone()

    model.zero_grad()
    big = collate(examples)
    big_sum, big_count = loss_of(big)
    (big_sum / big_count).backward()
    one_batch = _grads(model).clone()
    assert big_count.item() == total
    assert step_loss == pytest.approx((big_sum / big_count).item(), rel=1e-6)
    scale = one_batch.abs().max()
    assert (accumulated - one_batch).abs().max() <= 1e-6 * scale

    model.zero_grad()  # transformers' way: each micro-batch's own mean, averaged
    for batch in micro:
        s, c = loss_of(batch)
        (s / c / len(micro)).backward()
    mean_of_means = _grads(model)
    assert (mean_of_means - one_batch).abs().max() > 1e-2 * scale


def test_token_mean_share_under_ddp_and_shift():
    s = torch.tensor(12.0)
    assert token_mean_share(s, 48, world_size=4).item() == pytest.approx(1.0)
    assert shift_targets(torch.tensor([[5, 6, 7]])).tolist() == [[6, 7, IGNORE_INDEX]]
    assert count_targets({"labels": torch.tensor([[3, IGNORE_INDEX, 4], [IGNORE_INDEX, 1, 2]])}) == 3
