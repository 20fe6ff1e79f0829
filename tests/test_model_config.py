"""MODEL_CONFIG that cannot work: no layers, a width the heads do not divide, or a model that
cannot fit the memory the run has. Each is one line naming MODEL_CONFIG and exit code 2, from
the config alone (milliseconds), before any data work or allocation; DRY_RUN=1 says it too."""

from __future__ import annotations

import json

import pytest
from suite_control import CpuSpent

from conftest import TINY_CONFIG, launch, run_cli
from train.models.estimate import count_params

LLAMA = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 2, "intermediate_size": 128,
         "max_position_embeddings": 64}  # fmt: skip
MOE = {**LLAMA, "num_key_value_heads": 2, "num_local_experts": 4, "num_experts": 4, "num_experts_per_tok": 2}
SHAPES = {
    "deep": ({"n_layer": 100_000, "n_embd": 256, "n_head": 4}, "cannot fit"),
    "wide": ({"n_layer": 300, "n_embd": 8192, "n_head": 64}, "cannot fit"),
    "odd_width": ({"n_embd": 65}, "not divisible by the 2 heads"),
    "no_layers": ({"n_layer": 0}, "number of layers"),
    "no_heads": ({"n_head": 0}, "number of heads"),
    "layers_text": ({"n_layer": "2"}, "n_layer"),
    "llama_odd_width": ({"model_type": "llama", "hidden_size": 65, "num_attention_heads": 2}, "multiple"),
    # Round 5: each was a traceback (storage overflow, KeyError, AssertionError), a NaN run that made a
    # run folder and exited 1, or a run that trained and shipped final/.
    "gpt2_width_1e9": (
        {"n_embd": 1_000_000_000, "n_head": 1},
        "transformers cannot build this model (RuntimeError",
    ),
    "rope_type": (
        {**LLAMA, "rope_scaling": {"rope_type": "bogus", "factor": 2.0}},
        "rope_type 'bogus' is not one",
    ),
    "hidden_act": ({**LLAMA, "hidden_act": "bogus_act"}, "hidden_act 'bogus_act' is not an activation"),
    "pad_id": (
        {**LLAMA, "pad_token_id": 99_999_999},
        "pad_token_id 99999999 is not one of the model's 512 token ids",
    ),
    "rope_theta_0": ({**LLAMA, "rope_theta": 0}, "rope_theta is 0; it must be a number above 0"),
    "rope_theta_neg": ({**LLAMA, "rope_theta": -1}, "rope_theta is -1; it must be a number above 0"),
    "rope_factor_neg": (
        {**LLAMA, "rope_scaling": {"rope_type": "linear", "factor": -1.0}},
        "the rope_scaling factor is -1.0",
    ),
    "qwen3_moe": (
        {**MOE, "model_type": "qwen3_moe", "moe_intermediate_size": 32},
        "a mixture-of-experts model (qwen3_moe, 4",
    ),
    "mixtral": (
        {**MOE, "model_type": "mixtral"},
        "a mixture-of-experts model (mixtral, 4 experts): the kit's loss",
    ),
}


def write_config(tmp_path, change: dict):
    path = tmp_path / "model.json"
    path.write_text(json.dumps({**TINY_CONFIG, **change}))
    return path


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry_run", "run"])
@pytest.mark.parametrize("case", list(SHAPES))
def test_model_config_that_cannot_work_is_one_line(case, dry_run, corpus, tmp_path, capsys, monkeypatch):
    import train.models.build

    def no_build(*args, **kwargs):
        raise AssertionError("the model was built")

    monkeypatch.setattr(train.models.build, "build_model", no_build)
    change, expect = SHAPES[case]
    argv = [
        "pretrain",
        "--model_config",
        str(write_config(tmp_path, change)),
        "--data_path",
        str(corpus),
        "--vocab_size",
        "512",
        "--cache_dir",
        str(tmp_path / "cache"),
        "--output_dir",
        str(tmp_path / "runs"),
        "--max_length",
        "64",
        "--max_steps",
        "1",
    ]
    with CpuSpent() as cpu:
        assert run_cli(*argv, *(["--dry_run"] if dry_run else [])) == 2
    assert cpu.spent < 20  # CPU seconds; was more than 5 minutes for 100,000 layers
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: MODEL_CONFIG") and expect in err, err
    # refused from the config alone: no tokenizer, no token cache, no run folder
    assert not (tmp_path / "cache").exists() and not (tmp_path / "runs").exists()


def test_deep_model_is_counted_in_milliseconds():
    from transformers import GPT2Config

    h, layers, vocab, positions = 256, 100_000, 512, 64
    cfg = GPT2Config(n_layer=layers, n_embd=h, n_head=4, n_positions=positions, vocab_size=vocab)
    count_params(GPT2Config(n_layer=3, n_embd=h, n_head=4))  # the model classes imported once
    with CpuSpent() as cpu:
        n = count_params(cfg)
    assert cpu.spent < 0.5  # CPU seconds: building the 100,000 layers would take minutes
    assert n == vocab * h + positions * h + layers * (12 * h * h + 13 * h) + 2 * h


def test_dry_run_of_a_model_too_big_says_it_cannot_fit(corpus, tmp_path):
    """The issue's case through the launcher: DRY_RUN=1 used to estimate 6.9 TB and exit 0."""
    env = {"MODEL_CONFIG": str(write_config(tmp_path, SHAPES["wide"][0])), "DATA_PATH": str(corpus),
           "VOCAB_SIZE": "512", "CACHE_DIR": str(tmp_path / "cache"), "OUTPUT_DIR": str(tmp_path / "runs"),
           "DRY_RUN": "1"}  # fmt: skip
    result = launch("run_single_gpu.sh", env)
    assert result.returncode == 2, result.stderr
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1 and line.startswith("error: MODEL_CONFIG=") and "cannot fit" in line
    assert "GiB" in line and "Traceback" not in result.stdout + result.stderr


DEEP = "[" * 200_000 + "]" * 200_000  # past the interpreter's recursion limit: a RecursionError traceback


@pytest.mark.parametrize(
    "text", [DEEP, '{"model_type": "gpt2", "n_layer": ' + DEEP + "}"], ids=["list", "in_object"]
)
def test_a_model_config_nested_200k_deep_is_one_line(text, corpus, tmp_path, capsys):
    path = tmp_path / "model.json"
    path.write_text(text)
    argv = [
        "pretrain",
        "--model_config",
        str(path),
        "--data_path",
        str(corpus),
        "--vocab_size",
        "512",
        "--cache_dir",
        str(tmp_path / "cache"),
        "--output_dir",
        str(tmp_path / "runs"),
        "--max_steps",
        "1",
    ]
    assert run_cli(*argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: MODEL_CONFIG: {path} is not a transformers config.json (nested too deep to be a "
                   f"model config)")
    assert not (tmp_path / "runs").exists()


def model_folder(base_model, folder, change: dict | None = None, config=None):
    """base_model's tokenizer beside a config.json: base_model's own with `change`, or `config`'s
    tiny model saved whole."""
    import shutil

    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(base_model / name, folder / name)
    if config is not None:
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = AutoConfig.for_model(**config)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
        return folder
    shutil.copy(base_model / "model.safetensors", folder / "model.safetensors")
    raw = json.loads((base_model / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, **(change or {})}))
    return folder


def no_loading(monkeypatch):
    """A regression that loads or builds the model fails here at once, never asking the machine for
    terabytes (the kernel's out-of-memory killer ended the process: no line at all)."""
    import train.models.build
    import train.models.load

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded or built")

    monkeypatch.setattr(train.models.load, "load_pretrained", refuse)
    monkeypatch.setattr(train.models.build, "build_model", refuse)


TERABYTES = {"n_layer": 4000, "n_embd": 8192, "n_head": 64}  # 3.2T parameters: 12,000 GiB of float32 weights
MODEL_PATHS = {
    "2TB": (TERABYTES, None, "cannot fit: training it needs at least"),
    "deep": (None, None, "no model config could be read"),
    "qwen3_moe": (
        None,
        {
            **MOE,
            "model_type": "qwen3_moe",
            "moe_intermediate_size": 32,
            "num_hidden_layers": 1,
            "vocab_size": 512,
        },
        "a mixture-of-experts model (qwen3_moe, 4 experts)",
    ),
    "rope_theta_0": (None, {**LLAMA, "num_hidden_layers": 1, "vocab_size": 512}, "rope_theta is 0;"),
}


@pytest.mark.parametrize("case", list(MODEL_PATHS))
def test_a_model_path_that_cannot_work_is_one_line_before_loading(
    case, base_model, tmp_path, capsys, monkeypatch
):
    change, config, expect = MODEL_PATHS[case]
    folder = model_folder(base_model, tmp_path / "model", change, config)
    if case == "deep":
        (folder / "config.json").write_text('{"model_type": "gpt2", "n_layer": ' + DEEP + "}")
    if case == "rope_theta_0":  # saved sound, then edited as a user would
        raw = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(
            json.dumps({**raw, "rope_parameters": {"rope_type": "default", "rope_theta": 0}})
        )
    data = tmp_path / "chat.jsonl"
    data.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": f"q{i}"},
                        {"role": "assistant", "content": f"a{i}"},
                    ]
                }
            )
            + "\n"
            for i in range(8)
        )
    )
    no_loading(monkeypatch)
    capsys.readouterr()
    argv = [
        "sft",
        "--model_path",
        str(folder),
        "--data_path",
        str(data),
        "--cache_dir",
        str(tmp_path / "cache"),
        "--output_dir",
        str(tmp_path / "runs"),
        "--max_length",
        "32",
        "--max_steps",
        "1",
    ]
    assert run_cli(*argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"error: MODEL_PATH={folder}") and expect in err, err
    assert not (tmp_path / "runs").exists()


def bare(base_model, folder, change: dict | None = None, dtype=None, nan: bool = False):
    """base_model as a bare checkpoint (weights.safetensors beside config.json and the tokenizer)."""
    from safetensors.torch import load_file, save_file

    model_folder(base_model, folder, change)
    weights = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    if dtype is not None:
        weights = {k: v.to(dtype) for k, v in weights.items()}
    if nan:
        first = weights["transformer.h.0.mlp.c_fc.weight"]
        first.view(-1)[:3] = float("nan")
    save_file(weights, folder / "weights.safetensors")
    return folder


def test_import_of_a_config_asking_for_terabytes_is_one_line_before_building(
    base_model, tmp_path, capsys, monkeypatch
):
    src = bare(base_model, tmp_path / "src", TERABYTES)
    no_loading(monkeypatch)
    assert run_cli("import", str(src), str(tmp_path / "dest")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert (
        err.startswith("error: SRC: config.json: this model (3,221.6")
        and ("B parameters) cannot be built here: its float32 weights alone take 12,00") in err
    ), err
    assert err.endswith(" GiB") and "this machine's RAM has " in err, err
    assert not (tmp_path / "dest").exists()


def test_float8_weights_are_checked_for_nan_and_imported_as_bfloat16(base_model, tmp_path, capsys):
    import torch
    from transformers import AutoModelForCausalLM

    f8 = torch.float8_e4m3fn
    src = bare(base_model, tmp_path / "nan", dtype=f8, nan=True)
    # was: "isfinite" not implemented for Float8_e4m3fn
    assert run_cli("import", str(src), str(tmp_path / "bad")) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: SRC: weights.safetensors: transformer.h.0.mlp.c_fc.weight holds 3 non-finite "
                   "value(s) (NaN or inf); these weights cannot be trained or used"), err
    src = bare(base_model, tmp_path / "f8", dtype=f8)
    assert run_cli("import", str(src), str(tmp_path / "dest")) == 0
    assert "float8_e4m3fn weights are written as bfloat16" in capsys.readouterr().out
    # a float8 folder did not load
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "dest", local_files_only=True)
    assert model.dtype == torch.bfloat16
    from safetensors.torch import load_file

    exact = load_file(src / "weights.safetensors")
    assert all(
        torch.equal(v.to(torch.float32), exact[k].to(torch.float32))
        for k, v in model.state_dict().items()
        if k in exact
    )


def test_a_pad_id_of_the_files_vocabulary_past_the_tokenizers_is_dropped_not_a_traceback(tmp_path):
    """A hub config's pad id (31999 of 32000) with the kit's 512-token tokenizer: torch's Embedding
    asserted on it as a padding index; pretraining pads nothing and SFT sets the tokenizer's pad."""
    from train.models.build import build_config, build_model

    path = tmp_path / "llama.json"
    path.write_text(json.dumps({**LLAMA, "num_hidden_layers": 1, "vocab_size": 32000, "pad_token_id": 31999}))
    cfg = build_config("nano", str(path), 512, 0)
    assert cfg.vocab_size == 512 and cfg.pad_token_id is None
    build_model(cfg, gradient_checkpointing=False, seed=0)
    path.write_text(json.dumps({**LLAMA, "num_hidden_layers": 1, "vocab_size": 32000, "pad_token_id": -1}))
    # torch's padding index counts from the end
    assert build_config("nano", str(path), 512, 0).pad_token_id == -1
