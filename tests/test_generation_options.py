"""Generation options (issue 27, item 7): `python -m train generate` decodes with beams,
repetition_penalty and no_repeat_ngram_size exactly as transformers' generate() does (a causal
LM and a T5), greedy on request, its defaults from the folder's generation_config.json; a run's
GENERATION_CONFIG lands in final/generation_config.json, which plain generate() then follows;
bad values are one line with exit code 2."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import run_cli

PROMPT = "The quick brown"
CHATLM = {"num_beams": 3, "repetition_penalty": 1.2, "no_repeat_ngram_size": 2, "max_new_tokens": 10}


def tool(capsys, folder, *flags: str) -> str:
    """The tool's reply to PROMPT (stdout), the notes on stderr left aside."""
    capsys.readouterr()
    assert run_cli("generate", "--model", str(folder), "--prompt", PROMPT, *flags) == 0
    return capsys.readouterr().out.strip()


def reference(folder, seq2seq: bool = False, **options) -> str:
    """transformers' own generate() on the folder, the prompt encoded as the tool does."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = (AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM).from_pretrained(
        folder, local_files_only=True
    )
    ids = tok(PROMPT, add_special_tokens=seq2seq)["input_ids"]
    if seq2seq:
        ids = ids + [tok.eos_token_id]  # an untemplated encoder's source ends with end-of-text
    input_ids = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), **options)[0].tolist()
    if seq2seq:
        drop = {tok.pad_token_id, tok.eos_token_id, model.config.decoder_start_token_id}
        return tok.decode([i for i in out if i not in drop]).strip()
    return tok.decode(out[len(ids) :], skip_special_tokens=True).strip()


@pytest.fixture(scope="module")
def t5_folder(base_model, tmp_path_factory):
    """A tiny random T5 with the base run's tokenizer: what the tool reads as an encoder-decoder."""
    from transformers import AutoTokenizer, T5Config, T5ForConditionalGeneration

    tok = AutoTokenizer.from_pretrained(base_model, local_files_only=True)
    eos = tok.eos_token_id
    config = T5Config(
        vocab_size=448,
        d_model=32,
        d_ff=64,
        d_kv=16,
        num_layers=2,
        num_heads=2,
        dropout_rate=0.0,
        pad_token_id=eos,
        eos_token_id=eos,
        decoder_start_token_id=eos,
    )
    torch.manual_seed(1)  # a seed whose greedy reply is not end-of-text at once
    folder = tmp_path_factory.mktemp("t5") / "final"
    T5ForConditionalGeneration(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("flags,options", [
    (["--greedy"], dict(do_sample=False)),
    (["--num_beams", "3", "--repetition_penalty", "1.3", "--no_repeat_ngram_size", "2"],
     dict(do_sample=False, num_beams=3, repetition_penalty=1.3, no_repeat_ngram_size=2)),
])  # fmt: skip
def test_beams_and_greedy_equal_transformers_generate(base_model, t5_folder, capsys, flags, options):
    for folder, seq2seq in ((base_model, False), (t5_folder, True)):
        mine = tool(capsys, folder, *flags, "--max_new_tokens", "12")
        assert mine == reference(folder, seq2seq, max_new_tokens=12, **options), (folder, mine)
        assert mine, folder  # a reply to compare, not two empty strings


def test_sampling_stays_the_default_and_beams_change_the_reply(base_model, capsys):
    beams = tool(capsys, base_model, "--num_beams", "4", "--max_new_tokens", "12")
    assert beams == reference(base_model, num_beams=4, do_sample=False, max_new_tokens=12)
    sampled = {tool(capsys, base_model, "--max_new_tokens", "12", "--seed", str(s)) for s in range(2)}
    assert len(sampled) > 1  # still sampling without a flag or a saved setting


@pytest.mark.parametrize("flags,named", [
    (["--num_beams", "0"], "--num_beams"),
    (["--repetition_penalty", "0"], "--repetition_penalty"),
    (["--repetition_penalty", "-1.5"], "--repetition_penalty"),
    (["--no_repeat_ngram_size", "-1"], "--no_repeat_ngram_size"),
    (["--max_new_tokens", "0"], "--max_new_tokens"),
    (["--greedy", "--do_sample"], "not allowed with"),
])  # fmt: skip
def test_bad_generate_flags_are_one_line(base_model, capsys, flags, named):
    assert run_cli("generate", "--model", str(base_model), "--prompt", PROMPT, *flags) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error:") and named in err, err


def test_a_bad_value_in_the_folders_generation_config_is_one_line(base_model, tmp_path, capsys):
    import shutil

    folder = tmp_path / "final"
    shutil.copytree(base_model, folder)
    saved = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**saved, "num_beams": 0}))
    assert run_cli("generate", "--model", str(folder), "--prompt", PROMPT) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"error: --model {folder}: generation_config.json's num_beams"
    ), err


@pytest.fixture(scope="module")
def chatlm_run(tiny_config, corpus, cache_dir, tmp_path_factory):
    """A 2-step pretraining run with GENERATION_CONFIG = ChatLM's kind of settings."""
    root = tmp_path_factory.mktemp("gen")
    settings = root / "generation.json"
    settings.write_text(json.dumps(CHATLM))
    argv = ["--model_config", str(tiny_config), "--data_path", str(corpus), "--vocab_size", "512",
            "--cache_dir", str(cache_dir), "--output_dir", str(root / "runs"), "--max_length", "64",
            "--batch_size", "4", "--max_steps", "2", "--log_every", "1", "--run_name", "g",
            "--val_fraction", "0", "--generation_config", str(settings)]  # fmt: skip
    assert run_cli("pretrain", *argv) == 0
    return root / "runs" / "g"


def test_generation_config_is_saved_and_followed(chatlm_run, capsys):
    from transformers import GenerationConfig

    final = chatlm_run / "final"
    saved = GenerationConfig.from_pretrained(final, local_files_only=True)
    assert {k: getattr(saved, k) for k in CHATLM} == CHATLM
    assert saved.use_cache is True and saved.eos_token_id is not None  # the kit's contract kept
    decisions = json.loads((chatlm_run / "config.json").read_text())["decisions"]
    assert {"setting": "generation_config", "value": CHATLM} in [
        {k: d[k] for k in ("setting", "value")} for d in decisions
    ]
    # no flags: the folder's settings decide, exactly as plain generate() reads them
    assert tool(capsys, final) == reference(final)
    assert tool(capsys, final, "--num_beams", "1") == reference(final, num_beams=1)  # a flag overrides


@pytest.mark.parametrize("settings,named", [
    ({"num_beams": 0}, "num_beams"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"beams": 4}, "'beams'"),
    ({"temperature": 0.5}, "temperature"),  # transformers: only with do_sample true
    ({"max_new_tokens": "many"}, "max_new_tokens"),
    ({"use_cache": False}, "use_cache"),
    ([4], "JSON object"),
    ({"eos_token_id": 99999}, "eos_token_id 99999 is outside the model's"),  # checked once the model is built
    ({"max_length": -5}, "max_length in"),  # was accepted and shipped in final/generation_config.json
    ({"max_new_tokens": 10**12}, "max_new_tokens in"),
    ({"max_new_tokens": 1e12}, "max_new_tokens in"),
    # past the tiny model's 64 positions: checked once it is built
    ({"max_new_tokens": 100}, "max_new_tokens 100 in"),
])  # fmt: skip
def test_bad_generation_config_is_one_line(tiny_flags, tmp_path, capsys, settings, named):
    path = tmp_path / "gen.json"
    path.write_text(json.dumps(settings))
    capsys.readouterr()
    assert run_cli("pretrain", *tiny_flags, "--max_steps", "1", "--generation_config", str(path)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: GENERATION_CONFIG (--generation_config)"), err
    assert named in err[0], err
    assert not (tmp_path / "runs").exists()  # refused before any run folder
