"""Text-to-text from scratch in SFT mode and ChatLM-mini-Chinese checkpoints, on tiny real models:
a ChatLM-shaped T5 config (ReLU feed-forward, tied embeddings, pad 0, eos 1, decoder start 0)
trained from scratch on a prompt/response parquet with a BPE trained on that data, its final/
loading offline and generating; a causal MODEL_SIZE=nano run the same way; a ChatLM-style bare
state_dict (torch.save(model.state_dict()) + model_config.json) imported by `python -m train
import` and taken as MODEL_PATH, then fine-tuned; bad inputs one line with exit code 2."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest
import torch
from test_sft_data import make_tokenizer

from conftest import run_cli

CHATLM = dict(model_type="t5", vocab_size=20480, d_model=32, d_ff=64, d_kv=16, num_heads=2, num_layers=2,
              num_decoder_layers=2, feed_forward_proj="relu", tie_word_embeddings=True, pad_token_id=0,
              eos_token_id=1, decoder_start_token_id=0, dropout_rate=0.0)  # fmt: skip
PAIRS = [{"prompt": f"What is {i} plus {i}?", "response": f"{i} plus {i} is {2 * i}."} for i in range(24)]


@pytest.fixture(scope="module")
def where(tmp_path_factory) -> dict:
    """The parquet, the ChatLM-shaped config, and a cache shared by the module's runs."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("scratch")
    pq.write_table(pa.Table.from_pylist(PAIRS), root / "pairs.parquet")
    (root / "chatlm_config.json").write_text(json.dumps(CHATLM))
    return {"root": root, "data": str(root / "pairs.parquet"), "config": str(root / "chatlm_config.json")}


def sft(where: dict, run: str, *more: str) -> int:
    return run_cli(
        "sft",
        "--data_path",
        where["data"],
        "--output_dir",
        str(where["root"] / "runs"),
        "--run_name",
        run,
        "--cache_dir",
        str(where["root"] / "cache"),
        "--vocab_size",
        "300",
        "--max_length",
        "32",
        "--batch_size",
        "4",
        "--max_steps",
        "2",
        "--val_fraction",
        "0",
        "--num_workers",
        "0",
        "--tokenize_workers",
        "1",
        *more,
    )


@pytest.fixture(scope="module")
def t5_final(where) -> Path:
    # ChatLM: raw source
    assert sft(where, "t5", "--model_config", where["config"], "--template", "none") == 0
    return where["root"] / "runs" / "t5" / "final"


def test_chatlm_shaped_t5_trains_from_scratch_and_generates(t5_final, where):
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    model = AutoModelForSeq2SeqLM.from_pretrained(t5_final, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(t5_final, local_files_only=True)
    c = model.config
    assert (c.architectures, c.feed_forward_proj, c.tie_word_embeddings, c.num_layers, c.d_model) == (
        ["T5ForConditionalGeneration"], "relu", True, 2, 32)
    # The config's own ids hold, and the tokenizer trained here has them: pad 0, eos 1.
    assert (c.pad_token_id, c.eos_token_id, c.decoder_start_token_id) == (0, 1, 0)
    assert (tok.pad_token_id, tok.eos_token_id) == (0, 1) and c.vocab_size == -(-len(tok) // 64) * 64
    assert tok.tokenize(" plus") == ["Ġplus"]  # a BPE of this data's turns, not of the built-in corpus
    summary = json.loads((t5_final.parent / "summary.json").read_text())
    assert (summary["mode"], summary["model_kind"], summary["model_size"], summary["steps"]) == (
        "sft", "seq2seq", "custom", 2)
    assert summary["model_path"] is None and summary["final_loss"] < 10
    decisions = {
        d["setting"]: d for d in json.loads((t5_final.parent / "config.json").read_text())["decisions"]
    }
    assert decisions["model"]["value"] == "new t5" and "tokenizer_specials" in decisions
    # TEMPLATE=none: the encoder saw the raw prompt + eos, as ChatLM's own demo feeds it (tokenizer([txt]))
    inputs = tok("What is 3 plus 3?" + tok.eos_token, return_tensors="pt", add_special_tokens=False)
    assert json.loads((t5_final.parent / "config.json").read_text())["config"]["data"]["template"] == "none"
    out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert out[0, 0].item() == 0 and out.shape[1] > 1  # the decoder starts at pad, then writes


def test_causal_model_size_nano_trains_from_scratch(where):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert sft(where, "gpt", "--model_size", "nano") == 0
    final = where["root"] / "runs" / "gpt" / "final"
    model = AutoModelForCausalLM.from_pretrained(final, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(final, local_files_only=True)
    assert (model.config.model_type, model.config.n_layer, model.config.n_embd) == ("gpt2", 4, 256)
    assert model.config.vocab_size == -(-len(tok) // 64) * 64 and tok.tokenize(" plus") == ["Ġplus"]
    summary = json.loads((final.parent / "summary.json").read_text())
    assert (summary["model_kind"], summary["model_size"], summary["steps"]) == ("causal", "nano", 2)


def bare_folder(
    t5_final: Path, folder: Path, prefix: str = "", config_name: str = "model_config.json"
) -> dict:
    """ChatLM's way: torch.save(model.state_dict()) beside the T5Config dict and the tokenizer."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    model = AutoModelForSeq2SeqLM.from_pretrained(t5_final, local_files_only=True)
    folder.mkdir()
    weights = {prefix + k: v for k, v in model.state_dict().items()}
    torch.save(weights, folder / "chat_small_t5.best.bin")
    (folder / config_name).write_text(json.dumps(model.config.to_diff_dict()))
    AutoTokenizer.from_pretrained(t5_final, local_files_only=True).save_pretrained(folder)
    return model.state_dict()


def test_chatlm_state_dict_imports_by_command_and_as_model_path(t5_final, where, tmp_path):
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    weights = bare_folder(t5_final, tmp_path / "chatlm")
    assert run_cli("import", str(tmp_path / "chatlm"), str(tmp_path / "hf")) == 0
    imported = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == [
        "T5ForConditionalGeneration"
    ]
    assert all(torch.equal(v, weights[k]) for k, v in imported.state_dict().items())
    # ChatLM's hub folder: transformers' file names, but config.json's auto_map names its own
    # class over a plain T5: imported as T5 without running anything.
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config.update(
        auto_map={"AutoModelForSeq2SeqLM": "modeling_chat_model.TextToTextModel"},
        architectures=["TextToTextModel"],
    )
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    assert run_cli("import", str(tmp_path / "hf"), str(tmp_path / "plain")) == 0
    plain = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert "auto_map" not in plain and plain["architectures"] == ["T5ForConditionalGeneration"]
    # As MODEL_PATH, with the config named config.json and DDP's "module." on every key: the
    # folder that once got a hint about remote code.
    bare_folder(t5_final, tmp_path / "ddp", prefix="module.", config_name="config.json")
    # LoRA on imported weights
    assert sft(where, "ft", "--model_path", str(tmp_path / "ddp"), "--lora_r", "2") == 0
    summary = json.loads((where["root"] / "runs" / "ft" / "summary.json").read_text())
    assert (summary["steps"], summary["model_kind"]) == (2, "seq2seq")
    assert 0 < summary["n_trainable_params"] < summary["n_params"] / 4
    AutoModelForSeq2SeqLM.from_pretrained(where["root"] / "runs" / "ft" / "final", local_files_only=True)


def _pickle(folder: Path) -> list[str]:
    torch.save({"shared.weight": torch.zeros(2), "when": datetime.date(2024, 1, 1)}, folder / "w.bin")
    (folder / "model_config.json").write_text(json.dumps(CHATLM))
    make_tokenizer().save_pretrained(folder)
    return ["import", str(folder), str(folder.parent / "dest")]


def _keys(folder: Path) -> list[str]:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(**{**{k: v for k, v in CHATLM.items() if k != "model_type"}, "vocab_size": 64})
    weights = T5ForConditionalGeneration(config).state_dict()
    weights.pop("encoder.final_layer_norm.weight")
    torch.save({**weights, "extra.bias": torch.zeros(1)}, folder / "w.bin")
    (folder / "model_config.json").write_text(json.dumps({**CHATLM, "vocab_size": 64}))
    make_tokenizer().save_pretrained(folder)  # the tokenizer is fine: the weights are what is wrong
    return ["import", str(folder), str(folder.parent / "dest")]


BAD = {
    "both": (
        lambda f: ["sft", "--model_path", str(f), "--model_config", str(f / "config.json")],
        ["MODEL_PATH and MODEL_CONFIG are both set", "set one of them"],
    ),
    "no_weights": (lambda f: ["sft", "--model_path", str(f)], ["MODEL_PATH=", "no weights file"]),
    "no_config": (
        lambda f: (torch.save({"a": torch.zeros(1)}, f / "w.bin"), ["import", str(f), str(f.parent / "d")])[
            1
        ],
        ["SRC=", "no config.json or model_config.json"],
    ),
    "pickle": (_pickle, ["SRC: ", "weights_only=True"]),
    "keys": (_keys, ["missing encoder.final_layer_norm.weight", "unexpected extra.bias"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_line_exit_2(case, where, tmp_path, capsys):
    folder = tmp_path / "src"
    folder.mkdir()
    if case in ("both", "no_weights"):
        (folder / "config.json").write_text(json.dumps(CHATLM))
    make, expect = BAD[case]
    argv = make(folder)
    runs = tmp_path / "runs"
    assert run_cli(*argv, *(["--output_dir", str(runs)] if argv[0] == "sft" else [])) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and all(e in err for e in expect), err
    assert not runs.exists() and not (tmp_path / "dest").exists() and not (tmp_path / "d").exists()


def test_plain_text_from_scratch_reads_text_field(where, tmp_path):
    """TEXT_FIELD reaches the tokenizer's sample and the records of a new model's run (review finding)."""
    data = tmp_path / "body.jsonl"
    data.write_text(
        "".join(json.dumps({"body": f"The number {i} plus one is {i + 1}."}) + "\n" for i in range(24))
    )
    assert (
        run_cli(
            "sft",
            "--data_path",
            str(data),
            "--text_field",
            "body",
            "--model_size",
            "nano",
            "--output_dir",
            str(where["root"] / "runs"),
            "--run_name",
            "body",
            "--cache_dir",
            str(where["root"] / "cache"),
            "--vocab_size",
            "300",
            "--max_length",
            "32",
            "--batch_size",
            "4",
            "--max_steps",
            "1",
            "--val_fraction",
            "0",
            "--tokenize_workers",
            "1",
        )
        == 0
    )
    summary = json.loads((where["root"] / "runs" / "body" / "summary.json").read_text())
    assert (summary["data_format"], summary["n_conversations"]) == ("text:body", 24)
    from transformers import (
        AutoTokenizer,  # plain documents: a text model, no chat template to prompt it with
    )

    assert AutoTokenizer.from_pretrained(where["root"] / "runs" / "body" / "final").chat_template is None
