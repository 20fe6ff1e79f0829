"""Attention without dense masks: packed conversations through varlen_sdpa equal each
conversation run alone and no (T x T) mask is made; T5's relative position bias runs through
scaled_dot_product_attention (the kit's T5_SDPA, train/models/t5_attention.py) and equals eager T5."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import tiny_model
from train.core.attention import VARLEN_SDPA, use_attention, varlen_indices, varlen_sdpa_attention
from train.core.units import IGNORE_INDEX
from train.data.chat.packing import EAGER, VARLEN, PackedCollator, PackedRows, attention_for, pack


class SquareTensors(TorchDispatchMode):
    """Records every op output whose last two dims are both `n` (a mask or score matrix over
    the whole row) and every op that ran."""

    def __init__(self, n: int):
        super().__init__()
        self.n, self.square, self.ops = n, [], set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.add(str(func.overloadpacket))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if torch.is_tensor(t) and t.dim() >= 2 and t.shape[-1] == t.shape[-2] == self.n:
                self.square.append((str(func), tuple(t.shape), t.dtype))
        return out


def _conversations():
    rng = random.Random(0)
    examples = []
    for n in (23, 9, 31, 17, 12, 40, 5, 27):
        ids = [rng.randrange(512) for _ in range(n)]
        prompt = rng.choice([0, rng.randrange(1, n)])
        examples.append({"input_ids": ids, "labels": [IGNORE_INDEX] * prompt + ids[prompt:]})
    return examples


def _varlen_batch():
    examples = _conversations()
    p = pack([len(e["input_ids"]) for e in examples], 64)
    rows = PackedRows(examples, p.rows)
    batch = PackedCollator(pad_token_id=0, attention=VARLEN)([rows[k] for k in range(len(rows))])
    order = [i for row in p.rows for i in row]
    return examples, order, batch


def _model_inputs(batch):
    return {k: v for k, v in batch.items() if torch.is_tensor(v) and k != "labels"}


@pytest.fixture(scope="module")
def varlen_model():
    model = tiny_model().eval()
    use_attention(model, VARLEN_SDPA)
    assert model.config._attn_implementation == VARLEN_SDPA
    return model


def test_varlen_indices_gather_and_return_every_token():
    index, place = varlen_indices([3, 1, 2])
    # a short conversation's padding reads the tokens after its own, round the row
    assert index.tolist() == [[0, 1, 2], [3, 4, 5], [4, 5, 0]]
    assert place.tolist() == [0, 1, 2, 3, 6, 7]  # token t sits at place[t] of the 3 x 3 grid
    assert index.flatten()[place].tolist() == list(range(6))
    # the gather's backward adds into each token once per conversation reading it, never once
    # per pad slot (the pad slots all on token 0 made one serialized add: 19 ms of an H200 step)
    lengths = [700] + [3] * 100
    index, _ = varlen_indices(lengths)
    assert index.shape == (101, 700) and int(torch.bincount(index.flatten()).max()) <= 101
    q = torch.zeros(2, 1, 6, 4)  # two rows: the indices describe one, so this is refused, not run
    with pytest.raises(ValueError, match="one flat row of 6 tokens"):
        varlen_sdpa_attention(None, q, q, q, None, varlen_index=index, varlen_place=place)


def test_packed_varlen_equals_each_conversation_alone_without_a_dense_mask(varlen_model):
    examples, order, batch = _varlen_batch()
    n = sum(len(e["input_ids"]) for e in examples)
    # the batch: one flat row, no mask tensor of any kind, let alone (B, 1, T, T)
    assert batch["input_ids"].shape == (1, n) and "attention_mask" not in batch
    assert all(v.dim() <= 2 for v in batch.values() if torch.is_tensor(v))
    assert batch["varlen_index"].shape == (len(examples), max(len(e["input_ids"]) for e in examples))
    spy = SquareTensors(n)
    with torch.no_grad(), spy:
        out = varlen_model(**_model_inputs(batch), labels=batch["labels"])
    assert spy.square == [], spy.square  # nothing row x row was made: no mask, no score matrix
    assert (
        "aten._scaled_dot_product_flash_attention_for_cpu" in spy.ops
        or "aten.scaled_dot_product_attention" in spy.ops
    )
    reference = tiny_model().eval()  # the same weights (seed 0), transformers' own sdpa
    start, total, count = 0, 0.0, 0
    with torch.no_grad():
        for i in order:
            ids, labels = torch.tensor([examples[i]["input_ids"]]), torch.tensor(examples[i]["labels"])
            k = ids.shape[1]
            alone = reference(ids).logits[0]
            assert torch.allclose(out.logits[0, start : start + k], alone, atol=1e-5, rtol=0), i
            total += float(
                F.cross_entropy(alone[:-1], labels[1:], ignore_index=IGNORE_INDEX, reduction="sum")
            )
            count += int((labels[1:] != IGNORE_INDEX).sum())
            start += k
    assert out.loss.item() == pytest.approx(total / count, abs=1e-5)


def test_the_spy_sees_the_dense_mask_of_the_masked_path():
    """The check above can fail: transformers' sdpa given the same packed row builds the
    (1, 1, N, N) block mask from the restarting position_ids."""
    examples, _, batch = _varlen_batch()
    n = batch["input_ids"].shape[1]
    spy = SquareTensors(n)
    with torch.no_grad(), spy:
        tiny_model().eval()(batch["input_ids"], position_ids=batch["position_ids"])
    assert any(shape[-2:] == (n, n) for _, shape, _ in spy.square)


def test_packed_varlen_gradients_equal_separate_conversations():
    examples, order, batch = _varlen_batch()
    packed, separate = tiny_model(), tiny_model()
    use_attention(packed, VARLEN_SDPA)
    logits = packed(**_model_inputs(batch)).logits[0]
    labels = batch["labels"][0]
    F.cross_entropy(logits[:-1], labels[1:], ignore_index=IGNORE_INDEX, reduction="sum").backward()
    for i in order:
        alone = separate(torch.tensor([examples[i]["input_ids"]])).logits[0]
        target = torch.tensor(examples[i]["labels"])
        F.cross_entropy(alone[:-1], target[1:], ignore_index=IGNORE_INDEX, reduction="sum").backward()
    named = dict(separate.named_parameters())
    checked = 0
    for name, p in packed.named_parameters():
        if any(key in name for key in ("c_attn.weight", "wpe.weight", "c_fc.bias")):
            assert torch.allclose(p.grad, named[name].grad, atol=1e-5, rtol=1e-4), name
            checked += 1
    assert checked >= 4


def test_attention_dropout_still_applies_on_the_varlen_path():
    model = tiny_model()
    for module in model.modules():
        if hasattr(module, "attn_dropout"):
            module.attn_dropout.p = 0.5
    use_attention(model, VARLEN_SDPA)
    _, _, batch = _varlen_batch()
    inputs = _model_inputs(batch)
    with torch.no_grad():
        evaluated = model.eval()(**inputs).logits
        trained = model.train()(**inputs).logits
    assert (trained - evaluated).abs().max() > 1e-3


def test_unpacked_batches_take_transformers_sdpa_unchanged(varlen_model):
    """Validation and generation batches (a padded 2D mask, no varlen_index) on a model switched
    to varlen_sdpa give what plain sdpa gives."""
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    with torch.no_grad():
        got = varlen_model(ids, attention_mask=mask).logits
        want = tiny_model().eval()(ids, attention_mask=mask).logits
        assert torch.allclose(got[0], want[0], atol=1e-5, rtol=0)
        assert torch.allclose(got[1, :8], want[1, :8], atol=1e-5, rtol=0)
        steps = varlen_model.generate(ids[:1, :4], max_new_tokens=4, do_sample=False, pad_token_id=0)
        plain = tiny_model().eval().generate(ids[:1, :4], max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert steps.tolist() == plain.tolist()


def test_the_decision_names_the_kernel(varlen_model):
    on_cpu = attention_for("cpu", "fp32")
    assert on_cpu.kind == VARLEN == VARLEN_SDPA
    assert on_cpu.why.startswith(f"packed attention: {VARLEN_SDPA}") and "no (T x T) mask" in on_cpu.why
    assert "CUDA" in on_cpu.why  # why not flash-attention
    eager = tiny_model()
    eager.set_attn_implementation("eager")
    assert attention_for(eager, "fp32").kind == EAGER and "eager" in attention_for(eager, "fp32").why


# --- T5: the relative position bias through scaled_dot_product_attention ---------------------


def _tiny_t5():
    from train.models.build import build_config, build_model

    cfg = build_config("nano", None, 128, 1, "t5")
    cfg.update(dict(d_model=32, d_ff=64, d_kv=8, num_heads=4, relative_attention_num_buckets=8))
    return build_model(cfg, gradient_checkpointing=False, seed=0)


def _t5_batch():
    g = torch.Generator().manual_seed(0)
    source = torch.randint(2, 128, (3, 11), generator=g)
    mask = torch.ones_like(source)
    mask[1, 7:] = 0  # padding in the source
    mask[2, 4:] = 0
    source = source.masked_fill(mask == 0, 0)
    labels = torch.randint(2, 128, (3, 6), generator=g)
    labels[2, 4:] = IGNORE_INDEX
    return source, mask, labels


def test_kit_t5_runs_sdpa_and_equals_eager_t5():
    sdpa = _tiny_t5()
    # what build_model gives T5: sdpa with the bias folded once per forward (tests/test_t5_attention.py)
    assert sdpa.config._attn_implementation == "t5_sdpa"
    eager = _tiny_t5()
    eager.set_attn_implementation("eager")
    source, mask, labels = _t5_batch()
    spy = SquareTensors(-1)  # records the ops only
    sdpa.eval()
    eager.eval()  # dropout off: the two can be compared exactly
    with spy:
        got = sdpa(input_ids=source, attention_mask=mask, labels=labels)
    want = eager(input_ids=source, attention_mask=mask, labels=labels)
    # the fused kernel, and no matmul-softmax of eager attention
    assert "aten._scaled_dot_product_flash_attention_for_cpu" in spy.ops, sorted(spy.ops)
    assert "aten._softmax" not in spy.ops
    assert torch.allclose(got.logits, want.logits, atol=1e-5, rtol=0)
    assert got.loss.item() == pytest.approx(want.loss.item(), abs=1e-5)
    got.loss.backward()
    want.loss.backward()
    names = (
        "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
        "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
        "encoder.block.1.layer.0.SelfAttention.q.weight",
        "decoder.block.1.layer.1.EncDecAttention.k.weight",
        "shared.weight",
    )
    theirs = dict(eager.named_parameters())
    for name, p in sdpa.named_parameters():
        if name in names:
            assert torch.allclose(p.grad, theirs[name].grad, atol=1e-5, rtol=0), name
    with torch.no_grad():  # generation: the kv cache path, position bias from the cache offset
        a = sdpa.generate(
            input_ids=source, attention_mask=mask, max_new_tokens=5, do_sample=False, use_cache=True
        )
        b = eager.generate(
            input_ids=source, attention_mask=mask, max_new_tokens=5, do_sample=False, use_cache=True
        )
    assert a.tolist() == b.tolist()
