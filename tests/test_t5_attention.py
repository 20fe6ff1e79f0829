"""T5_SDPA (train/models/t5_attention.py): T5's relative position bias folded with the mask once per
forward and handed to scaled_dot_product_attention. A tiny T5 (2 + 2 layers, width 32) through the
kit's forward_loss, fp32: a span-corruption pretraining batch and a padded SFT batch give the losses,
logits and gradients of transformers' eager T5 (and its sdpa) to 1e-5; the masks are made once,
however many layers; generation and final/ are plain transformers'."""

from __future__ import annotations

import copy
import json
from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from train.core.step import forward_loss
from train.core.units import IGNORE_INDEX
from train.data.span_corruption import corrupt, random_spans_noise_mask
from train.models.build import build_config, build_model
from train.models.family import ENCODER_DECODER
from train.models.t5_attention import T5_SDPA, install

VOCAB = 128
CPU = torch.device("cpu")
TOL = 1e-5


def tiny_t5(layers: int = 2, checkpointing: bool = False, dropout: float = 0.0):
    cfg = build_config("nano", None, VOCAB, 1, "t5")
    cfg.update(
        dict(
            d_model=32,
            d_ff=64,
            d_kv=8,
            num_heads=4,
            num_layers=layers,
            num_decoder_layers=layers,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=16,
            dropout_rate=dropout,
        )
    )
    return build_model(cfg, gradient_checkpointing=checkpointing, seed=0)


def span_batch(rows: int = 4, window: int = 24) -> dict:
    """Span corruption of random windows, as the pretraining data makes it: every source the same
    length, no mask (forward_loss gives it the mask of ones, as the kit's step does)."""
    rng = np.random.default_rng(0)
    sentinels = list(range(VOCAB - 1, VOCAB - 12, -1))
    pairs = [corrupt(rng.integers(2, VOCAB - 12, window), random_spans_noise_mask(window, rng), sentinels, 1)
             for _ in range(rows)]
    return {"input_ids": torch.tensor(np.stack([s for s, _ in pairs])),
            "labels": torch.tensor(np.stack([t for _, t in pairs]))}


def sft_batch() -> dict:
    """SFT's seq2seq rows: sources right-padded with their mask, targets padded with IGNORE_INDEX."""
    g = torch.Generator().manual_seed(1)
    source = torch.randint(2, VOCAB, (3, 13), generator=g)
    mask = torch.ones_like(source)
    mask[1, 9:] = 0
    mask[2, 4:] = 0
    labels = torch.randint(2, VOCAB, (3, 7), generator=g)
    labels[1, 5:] = IGNORE_INDEX
    labels[2, 2:] = IGNORE_INDEX
    return {"input_ids": source * mask, "attention_mask": mask, "labels": labels}


def loss_and_grads(model, batch: dict, precision: str = "fp32"):
    loss = forward_loss(model, dict(batch), CPU, precision, layout=ENCODER_DECODER)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def logits(model, batch: dict) -> torch.Tensor:
    decoder = model.prepare_decoder_input_ids_from_labels(labels=batch["labels"])
    return model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                 decoder_input_ids=decoder).logits


def eager_twin(model, kind: str = "eager"):
    other = copy.deepcopy(model)
    other.set_attn_implementation(kind)  # the fold hooks stand aside for any other implementation
    return other


@pytest.mark.parametrize("make_batch", [span_batch, sft_batch], ids=["pretraining", "sft_padded"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_losses_logits_and_gradients_equal_eager_t5(make_batch, checkpointing):
    kit = tiny_t5(checkpointing=checkpointing)
    assert kit.config._attn_implementation == T5_SDPA  # what build_model gives the t5 family
    batch = make_batch()
    got_loss, got = loss_and_grads(kit, batch)
    for kind in ("eager", "sdpa"):  # transformers' own T5, eager and its sdpa path: today's path
        other = eager_twin(tiny_t5(checkpointing=checkpointing), kind)
        want_loss, want = loss_and_grads(other, batch)
        assert got_loss.item() == pytest.approx(want_loss.item(), abs=TOL)
        assert got.keys() == want.keys() and len(got) == len(list(kit.parameters()))
        for name, grad in got.items():
            assert torch.allclose(grad, want[name], atol=TOL, rtol=0), (kind, name)
    kit.eval()
    other.eval()
    with torch.no_grad():
        real = (batch["labels"] != IGNORE_INDEX)[..., None]
        assert torch.allclose(logits(kit, batch) * real, logits(other, batch) * real, atol=TOL, rtol=0)


class ScoreTensors(TorchDispatchMode):
    """Counts fresh tensors (not views, not in-place) of four dims whose last two are a (query, key)
    pair of the batch, by op."""

    def __init__(self, pairs: set):
        super().__init__()
        self.pairs, self.made = pairs, Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        returns = func._schema.returns
        for i, t in enumerate(out if isinstance(out, (tuple, list)) else (out,)):
            fresh = i >= len(returns) or returns[i].alias_info is None
            if torch.is_tensor(t) and fresh and t.dim() == 4 and tuple(t.shape[-2:]) in self.pairs:
                self.made[str(func.overloadpacket)] += 1
        return out


def masks_made(model, batch: dict) -> Counter:
    """Score-shaped tensors of one no-grad forward: the bias is frozen there, so every attention runs
    sdpa's fused CPU kernel and what is left is the masks."""
    source, target = batch["input_ids"].shape[1], batch["labels"].shape[1]
    spy = ScoreTensors({(source, source), (target, target), (target, source)})
    with torch.no_grad(), spy:
        forward_loss(model, dict(batch), CPU, "fp32", layout=ENCODER_DECODER)
    return spy.made


def test_the_masks_are_made_once_per_forward_whatever_the_layers():
    batch = sft_batch()
    two, four = masks_made(tiny_t5(2), batch), masks_made(tiny_t5(4), batch)
    # once per forward: the source's and the cross-attention's padding masks (bitwise_and: sdpa's
    # boolean ones; full_like: the cross-attention's made additive); the encoder's bias with its
    # padding (where), the decoder's with the causal pattern (masked_fill), the zeros T5 makes for
    # the cross-attention's bias
    want = Counter({"aten.bitwise_and": 2, "aten.full_like": 1, "aten.where": 1, "aten.masked_fill": 1,
                    "aten.zeros": 1})
    assert two == four == want, (two, four)
    before = masks_made(eager_twin(tiny_t5(4), "sdpa"), batch)  # transformers' sdpa: masks in every layer
    assert before["aten.where"] >= 3 * 4, before
    # no padding in pretraining: no padding mask at all, the decoder's causal fold and T5's zeros
    assert masks_made(tiny_t5(4), span_batch()) == Counter({"aten.masked_fill": 1, "aten.zeros": 1})


def test_the_cross_attention_takes_the_padding_mask_alone(monkeypatch):
    """The cross-attention's bias is zeros in T5: sdpa gets the padding mask made once per stack
    (additive, no head dimension), or none without padding (a flash kernel on a GPU); the
    self-attentions get the folded bias."""
    from train.models import t5_attention

    seen = []
    real = t5_attention.F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        seen.append(
            (q.shape[2], k.shape[2], None if attn_mask is None else (attn_mask.dtype, attn_mask.shape[1]))
        )
        return real(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(t5_attention.F, "scaled_dot_product_attention", spy)
    model = tiny_t5()
    for batch, cross in ((span_batch(), None), (sft_batch(), (torch.float32, 1))):
        seen.clear()
        with torch.no_grad():
            forward_loss(model, dict(batch), CPU, "fp32", layout=ENCODER_DECODER)
        target, source = batch["labels"].shape[1], batch["input_ids"].shape[1]
        assert [m for q, k, m in seen if (q, k) == (target, source)] == [cross, cross]
        assert all(m is not None and m[0] == torch.float32 for q, k, m in seen if q == k)  # the folded bias


def test_bf16_autocast_runs_close_to_fp32():
    batch = sft_batch()
    fp32, _ = loss_and_grads(tiny_t5(), batch)
    half, grads = loss_and_grads(tiny_t5(), batch, "bf16")
    assert half.item() == pytest.approx(fp32.item(), rel=2e-2)
    assert all(torch.isfinite(g).all() for g in grads.values())


def test_attention_dropout_still_applies():
    """T5's attention dropout is its dropout_rate as a float on each attention: with every
    nn.Dropout off, only the attentions still drop, and two draws differ until their rate is 0."""
    model = tiny_t5(dropout=0.5)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    batch = sft_batch()

    def two_draws():
        losses = []
        for seed in (0, 1):
            torch.manual_seed(seed)
            losses.append(forward_loss(model, dict(batch), CPU, "fp32", layout=ENCODER_DECODER).item())
        return losses

    first, second = two_draws()
    assert abs(first - second) > 1e-4
    for module in model.modules():
        if hasattr(module, "has_relative_attention_bias"):
            module.dropout = 0.0
    first, second = two_draws()
    assert first == second


def test_generation_and_final_are_plain_transformers(tmp_path):
    model = tiny_t5().eval()
    model.generation_config.eos_token_id = None  # run the whole length: more steps compared
    reference = eager_twin(model)
    batch = sft_batch()
    with torch.no_grad():
        for cache in (True, False):
            got = model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                 max_new_tokens=6, do_sample=False, use_cache=cache)
            want = reference.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                      max_new_tokens=6, do_sample=False, use_cache=cache)
            assert got.tolist() == want.tolist()
    model.save_pretrained(tmp_path)
    assert T5_SDPA not in (tmp_path / "config.json").read_text()
    assert "attn_implementation" not in json.loads((tmp_path / "config.json").read_text())
    from transformers import AutoModelForSeq2SeqLM

    loaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path, local_files_only=True).eval()
    assert loaded.config._attn_implementation == "sdpa"
    assert not any(m._forward_pre_hooks for m in loaded.modules())
    with torch.no_grad():
        assert torch.allclose(logits(loaded, batch), logits(model, batch), atol=TOL, rtol=0)


def test_install_twice_adds_no_second_hook():
    model = tiny_t5()
    hooks = sum(len(m._forward_pre_hooks) for m in model.modules())
    install(model)
    assert sum(len(m._forward_pre_hooks) for m in model.modules()) == hooks == 4  # each self-attention
