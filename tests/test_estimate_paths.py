"""The peak-memory estimate of every path against the allocated bytes at the peak of a real CPU step
(live_bytes.allocated_peak: the allocator's own events, forward, backward and optimizer): T5
pretraining's span lengths, T5 SFT's padded pairs, packed SFT's varlen grid, Llama and Qwen3, and preference
pairs (chosen and rejected rows, a frozen reference copy), each at two sizes, each within 10 %. The
estimate is asked as the plan asks it: estimate_for_run at the rows the data gives (adapt.row_shape)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import config
from train.core.attention import VARLEN_SDPA, use_attention
from train.core.measure.live_bytes import allocated_peak, held_by
from train.core.model import count_params
from train.core.optim.registry import build_optimizer
from train.core.seq2seq import span_lengths
from train.core.step import train_step
from train.core.units import IGNORE_INDEX
from train.data.chat.batching import Seq2SeqCollator
from train.data.chat.conversation_cache import SFTDataset
from train.data.chat.packing import PackedCollator, PackedRows, pack
from train.distributed.parallel import build_scaler
from train.models.build import build_config, build_model
from train.models.estimate import estimate_for_run
from train.models.family import CAUSAL_LM, ENCODER_DECODER, family_of
from train.run.plan.adapt import row_shape

VOCAB = 512
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def measured_peak(model, batches: list[dict], precision: str, layout=CAUSAL_LM, objective=None,
                  accum: int = 1) -> int:
    """Bytes allocated at the peak of the second of two real train_steps (the first makes AdamW's state)."""
    cfg = config.resolve(None, {"learning_rate": 1e-3})
    optimizer, _ = build_optimizer(cfg.optim, model, CPU)
    scaler = build_scaler(precision, model, CPU)

    def step():
        train_step(model, optimizer, scaler, iter(batches), accum, 1.0, CPU, precision, layout=layout,
                   objective=objective)

    step()
    return allocated_peak(step, held_by(model, optimizer))


def estimated(
    model,
    mode: str,
    batch_size: int,
    precision: str,
    dataset=None,
    collate=None,
    max_length: int = 0,
    accum: int = 1,
    **settings,
) -> float:
    cfg = config.resolve(None, {"mode": mode, "batch_size": batch_size, "gradient_accumulation_steps": accum,
                                **settings})
    shape = row_shape(dataset, collate, max_length, mode, family_of(model).layout)
    return estimate_for_run(model.config, count_params(model), cfg, shape["max_length"], precision, "cpu",
                            target_length=shape.get("target_length"), packed=shape.get("packed"))["peak"]


def within_10_percent(est: float, peak: float) -> None:
    said = f"estimate {est / 2**20:.2f} MiB, measured {peak / 2**20:.2f} MiB: {(est - peak) / peak:+.1%}"
    print(said)
    assert abs(est - peak) <= 0.1 * peak, said


def tiny_t5(dropout: float = 0.1):
    hf = build_config("nano", None, VOCAB, 0, "t5")
    hf.d_model, hf.num_layers, hf.num_decoder_layers, hf.num_heads, hf.d_kv, hf.d_ff = 64, 2, 2, 2, 32, 256
    hf.dropout_rate = dropout
    return build_model(hf, False, 0)


@pytest.mark.parametrize(
    ("batch", "source", "precision", "accum"), [(8, 128, "bf16", 1), (4, 256, "fp32", 2)]
)
def test_t5_pretraining(batch, source, precision, accum):
    """Span corruption's shapes: a MAX_LENGTH source and its shorter target (256 -> 58 tokens)."""
    model = tiny_t5()
    target = span_lengths(source)[1]
    gen = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(1, VOCAB, (batch, source), generator=gen),
                "labels": torch.randint(1, VOCAB, (batch, target), generator=gen)} for _ in range(2 * accum)]
    peak = measured_peak(model, batches, precision, layout=ENCODER_DECODER, accum=accum)
    est = estimated(model, "pretrain", batch, precision, max_length=source, accum=accum)
    within_10_percent(est, peak)


@pytest.mark.parametrize(("rows", "longest", "precision"), [(8, 96, "fp32"), (4, 192, "bf16")])
def test_t5_sft(rows, longest, precision):
    """Pairs of varied lengths padded to the batch's longest source and target: the estimate at the
    longest the data gives (row_shape), not at MAX_LENGTH."""
    model = tiny_t5()
    rng = np.random.default_rng(0)
    examples = []
    for i in range(rows):
        s, t = (
            (longest, longest // 2)
            if i == 0
            else (int(rng.integers(8, longest)), int(rng.integers(4, longest)))
        )
        examples.append(
            {"input_ids": rng.integers(1, VOCAB, s).tolist(), "labels": rng.integers(1, VOCAB, t).tolist()}
        )
    dataset, collate = SFTDataset(examples, ENCODER_DECODER), Seq2SeqCollator(0)
    batch = collate(examples)
    peak = measured_peak(model, [batch, batch], precision, layout=ENCODER_DECODER)
    est = estimated(model, "sft", rows, precision, dataset, collate, max_length=512)
    within_10_percent(est, peak)


def conversations(n: int, longest: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = longest if i == 0 else int(rng.integers(8, longest))
        ids = rng.integers(1, VOCAB, length).tolist()
        out.append({"input_ids": ids, "labels": [IGNORE_INDEX] * (length // 3) + ids[length // 3:]})
    return out


def tiny_gpt2(dropout: float = 0.1):
    hf = build_config("nano", None, VOCAB, 0)
    hf.n_layer, hf.n_embd, hf.n_head, hf.n_positions = 2, 128, 2, 512
    hf.resid_pdrop = hf.embd_pdrop = hf.attn_pdrop = dropout
    return build_model(hf, False, 0)


@pytest.mark.parametrize(
    ("n", "max_length", "longest", "precision"), [(24, 128, 100, "fp32"), (40, 256, 160, "bf16")]
)
def test_packed_sft(n, max_length, longest, precision):
    """PACKING=1: rows of conversations through the varlen attention, whose q, k, v and output take
    conversations x longest slots (estimate_terms.PackedGrid); every row in one micro-batch, so the
    batch's grid is the data's."""
    model = tiny_gpt2()
    use_attention(model, VARLEN_SDPA)
    examples = conversations(n, longest)
    packing = pack([len(e["input_ids"]) for e in examples], max_length)
    dataset = PackedRows(examples, packing.rows)
    collate = PackedCollator(0, attention=VARLEN_SDPA)
    batch = collate([dataset[i] for i in range(len(dataset))])
    peak = measured_peak(model, [batch, batch], precision)
    est = estimated(
        model, "sft", len(dataset), precision, dataset, collate, max_length=max_length, packing=True
    )
    within_10_percent(est, peak)


@pytest.mark.parametrize("family", ["llama", "qwen3"])  # qwen3: llama's block with q/k norms
@pytest.mark.parametrize(("batch", "length", "precision"), [(8, 128, "fp32"), (4, 256, "bf16")])
def test_llama(batch, length, precision, family):
    import transformers

    config_class = transformers.LlamaConfig if family == "llama" else transformers.Qwen3Config
    hf = config_class(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=2,
        head_dim=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    model = build_model(hf, False, 0)
    ids = torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(0))
    peak = measured_peak(model, [{"input_ids": ids}] * 2, precision)
    est = estimated(model, "pretrain", batch, precision, max_length=length)
    within_10_percent(est, peak)


@pytest.mark.parametrize(("pairs", "length", "precision"), [(4, 64, "fp32"), (2, 128, "bf16")])
def test_preference_pairs(pairs, length, precision):
    """DPO: BATCH_SIZE pairs are 2 x BATCH_SIZE rows in one forward, a frozen fp32 copy beside the policy."""
    from train.core.preference.loss import PreferenceObjective
    from train.core.preference.reference import build_reference
    from train.data.chat.pair_batching import PairCollator

    model = tiny_gpt2()
    rng = np.random.default_rng(0)
    prompt = length // 4

    def side() -> list[int]:
        return rng.integers(1, VOCAB, length - prompt).tolist()

    data = []
    for _ in range(pairs):
        chosen, rejected = side(), side()
        data.append({"prompt_ids": rng.integers(1, VOCAB, prompt).tolist(), "chosen_ids": chosen,
                     "chosen_labels": chosen, "rejected_ids": rejected, "rejected_labels": rejected})
    batch = PairCollator(0)(data)
    objective = PreferenceObjective(
        CAUSAL_LM, "sigmoid", reference=build_reference("copy", model, layout=CAUSAL_LM)
    )
    peak = measured_peak(model, [batch, batch], precision, objective=objective)
    copy_bytes = 4 * count_params(model)  # the frozen copy, made before the tracked step: held throughout
    est = estimated(model, "dpo", pairs, precision, max_length=length, reference="copy")
    within_10_percent(est, peak + copy_bytes)
