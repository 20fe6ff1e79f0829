"""DROPOUT: every dropout setting of every family (gpt2 resid/embd/attn_pdrop, llama attention_dropout,
t5 dropout_rate) in a new model's config and modules, and in a loaded model's where it is set; 0 for a
MODEL_SIZE model when empty; the value said in the start line and saved with final/. A model whose
dropout is off computes in train mode exactly what it computes in eval mode: the check that no
dropout setting was missed (Llama's and T5's attention read a float of their own at forward)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import run_cli
from train.models import FAMILIES
from train.models.build import build_config, build_model
from train.models.family import dropout_of, set_dropout
from train.models.load import load_pretrained

FIELDS = {"gpt2": ("resid_pdrop", "embd_pdrop", "attn_pdrop"), "llama": ("attention_dropout",),
          "qwen3": ("attention_dropout",),
          "t5": ("dropout_rate",)}  # fmt: skip


def tiny(family: str, dropout: float | None):
    cfg = build_config("nano", None, 128, 0, family, dropout)
    for name, value in (
        ("n_layer", 1),
        ("num_hidden_layers", 1),
        ("num_layers", 1),
        ("num_decoder_layers", 1),
    ):
        if hasattr(cfg, name):
            setattr(cfg, name, value)
    if getattr(cfg, "layer_types", None):  # Qwen3's: one entry per layer
        cfg.layer_types = cfg.layer_types[:1]
    return cfg


def train_equals_eval(model) -> bool:
    ids = torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    extra = {"decoder_input_ids": ids[:, :6]} if model.config.is_encoder_decoder else {}
    torch.manual_seed(1)
    with torch.no_grad():
        model.train()
        a = model(input_ids=ids, **extra).logits
        model.eval()
        b = model(input_ids=ids, **extra).logits
    return torch.equal(a, b)


def module_values(model, family: str) -> set[float]:
    values = {m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)}
    for m in model.modules():
        values |= {
            getattr(m, n) for n in FAMILIES[family].dropout_modules if isinstance(getattr(m, n, None), float)
        }
    return values


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen3", "t5"])
def test_a_new_model_carries_dropout_in_every_setting(family):
    assert FAMILIES[family].dropout == FIELDS[family]
    cfg = tiny(family, 0.25)
    assert [getattr(cfg, n) for n in FIELDS[family]] == [0.25] * len(FIELDS[family])
    model = build_model(cfg, gradient_checkpointing=False, seed=0)
    assert module_values(model, family) == {0.25} and dropout_of(model) == 0.25
    assert not train_equals_eval(model)  # it drops

    # DROPOUT empty: a MODEL_SIZE model has none (transformers' own is 0.1 for gpt2, t5)
    empty = tiny(family, None)
    assert [getattr(empty, n) for n in FIELDS[family]] == [0.0] * len(FIELDS[family])
    assert train_equals_eval(build_model(empty, gradient_checkpointing=False, seed=0))


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen3", "t5"])
def test_a_loaded_model_takes_dropout_where_set(family, tmp_path):
    build_model(tiny(family, 0.1), gradient_checkpointing=False, seed=0).save_pretrained(tmp_path)
    model = load_pretrained(tmp_path, False, FAMILIES[family])
    assert dropout_of(model) == 0.1 and not train_equals_eval(model)  # its own
    assert set_dropout(model, 0.0) > 0
    assert module_values(model, family) == {0.0} and train_equals_eval(model)
    set_dropout(model, 0.3)
    assert [getattr(model.config, n) for n in FIELDS[family]] == [0.3] * len(FIELDS[family])
    assert module_values(model, family) == {0.3}


def test_sft_sets_dropout_on_the_loaded_model_and_says_it(base_model, tmp_path, capsys):
    assert json.loads((base_model / "config.json").read_text())["resid_pdrop"] == 0.1  # MODEL_CONFIG's own
    data = tmp_path / "sft.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"Say {i}.", "response": f"{i} {i}."}) + "\n" for i in range(16))
    )
    argv = [
        "--model_path",
        str(base_model),
        "--data_path",
        str(data),
        "--output_dir",
        str(tmp_path / "runs"),
        "--cache_dir",
        str(tmp_path / "cache"),
        "--max_length",
        "64",
        "--batch_size",
        "4",
        "--max_steps",
        "1",
        "--num_workers",
        "0",
        "--val_fraction",
        "0",
    ]
    assert run_cli("sft", *argv, "--dropout", "0.2", "--run_name", "set") == 0
    out = capsys.readouterr().out
    assert "dropout = 0.2  (DROPOUT=0.2 in every dropout setting of MODEL_PATH's model (its own: 0.1))" in out
    assert "params, dropout 0.2)" in out  # the start line
    final = json.loads((tmp_path / "runs" / "set" / "final" / "config.json").read_text())
    assert [final[n] for n in FIELDS["gpt2"]] == [0.2] * 3
    record = json.loads((tmp_path / "runs" / "set" / "config.json").read_text())
    assert record["config"]["model"]["dropout"] == 0.2 and record["resolved"]["dropout"] == 0.2

    assert run_cli("sft", *argv, "--run_name", "own") == 0  # empty: the model's own
    assert "params, dropout 0.1)" in capsys.readouterr().out
