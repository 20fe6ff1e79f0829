"""Preference training switches every dropout off, modules and the rates attention modules keep as
floats (T5Attention.dropout = dropout_rate): a T5 with its own dropout_rate 0.1 and a GPT-2 with
attn_pdrop 0.1 both start DPO at ln 2 with REFERENCE=copy (DROPOUT empty: the dpo preset's 0), and the
decision says how many went off."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from test_sft_data import make_tokenizer

from conftest import read_jsonl, run_cli
from train.models.family import set_dropout

PAIRS = [
    {"prompt": f"Say {i}.", "chosen": f"{i} {i}.", "rejected": f"no {i % 5} way" * (1 + i % 3)}
    for i in range(16)
]


def _folder(root: Path, family: str, **rates) -> Path:
    """A tiny model of the family with the given dropout rates, saved with a kit-style tokenizer."""
    from train.core.model import padded_vocab
    from train.models.build import build_config, build_model

    tok = make_tokenizer()
    tok.pad_token = tok.eos_token
    cfg = build_config("nano", None, padded_vocab(len(tok)), tok.eos_token_id, family)
    shape = (
        dict(num_layers=2, num_decoder_layers=2, d_model=32, d_ff=64, num_heads=2, d_kv=16)
        if family == "t5"
        else dict(n_layer=2, n_embd=32, n_head=2, n_positions=64)
    )
    for key, value in {**shape, **rates}.items():
        setattr(cfg, key, value)
    folder = root / family
    build_model(cfg, gradient_checkpointing=False, seed=0).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _first_dpo_step(root: Path, folder: Path, capsys) -> tuple[dict, str]:
    (root / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    argv = [
        "dpo",
        "--model_path",
        str(folder),
        "--data_path",
        str(root / "pairs.jsonl"),
        "--reference",
        "copy",
        "--template",
        "none",
        "--output_dir",
        str(root / "runs"),
        "--cache_dir",
        str(root / "cache"),
        "--max_length",
        "64",
        "--batch_size",
        "4",
        "--max_steps",
        "2",
        "--log_every",
        "1",
        "--num_workers",
        "0",
        "--learning_rate",
        "1e-3",
        "--run_name",
        folder.name,
    ]
    assert run_cli(*argv) == 0
    rows = [r for r in read_jsonl(root / "runs" / folder.name / "metrics.jsonl") if "loss" in r]
    return rows[0], capsys.readouterr().out


def test_t5_with_dropout_rate_starts_dpo_at_ln2(tmp_path, capsys):
    folder = _folder(tmp_path, "t5", dropout_rate=0.1)
    first, out = _first_dpo_step(tmp_path, folder, capsys)
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert first["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    # 2 encoder blocks x 2 + 2 decoder blocks x 3 residual dropouts + the feed-forward's inner one in each
    # block (4) + one per stack (2) = 16 layers; the attention rate of each self- and cross-attention: 6
    assert "22 dropout settings off" in out


def test_gpt2_with_attn_pdrop_starts_dpo_at_ln2(tmp_path, capsys):
    folder = _folder(tmp_path, "gpt2", attn_pdrop=0.1, resid_pdrop=0.1, embd_pdrop=0.1)
    first, out = _first_dpo_step(tmp_path, folder, capsys)
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-5)
    # GPT-2's attention hands its kernel attn_dropout.p: a layer, no separate rate
    assert "7 dropout settings off" in out  # embeddings 1 + 2 blocks x (attention, its residual, the MLP's)


def test_set_dropout_counts_layers_and_rates_and_leaves_none_on():
    from transformers import LlamaConfig, LlamaForCausalLM, T5Config, T5ForConditionalGeneration

    t5 = T5ForConditionalGeneration(
        T5Config(
            vocab_size=64,
            d_model=16,
            d_ff=32,
            num_layers=1,
            num_decoder_layers=1,
            num_heads=2,
            d_kv=8,
            dropout_rate=0.2,
        )
    )
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            attention_dropout=0.3,
        )
    )
    assert set_dropout(t5, 0.0) == 9 + 3  # layers: 3 + 4 in the blocks, 1 per stack; rates: 3 attentions
    assert set_dropout(llama, 0.0) == 2  # no dropout modules at all: only the attention rate
    for model in (t5, llama):
        for module in model.modules():
            assert not isinstance(module, torch.nn.Dropout) or module.p == 0
            assert not any("dropout" in k and isinstance(v, float) and v for k, v in vars(module).items())
        assert set_dropout(model, 0.0) == 0  # nothing left on
