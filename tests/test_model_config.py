"""MODEL_CONFIG that cannot work: no layers, a width the heads do not divide, or a model that
cannot fit the memory the run has. Each is one line naming MODEL_CONFIG and exit code 2, from
the config alone (milliseconds), before any data work or allocation; DRY_RUN=1 says it too."""

from __future__ import annotations

import json

import pytest
from suite_control import CpuSpent

from conftest import TINY_CONFIG, launch, run_cli
from train.models.estimate import count_params

SHAPES = {
    "deep": ({"n_layer": 100_000, "n_embd": 256, "n_head": 4}, "cannot fit"),
    "wide": ({"n_layer": 300, "n_embd": 8192, "n_head": 64}, "cannot fit"),
    "odd_width": ({"n_embd": 65}, "not divisible by the 2 heads"),
    "no_layers": ({"n_layer": 0}, "number of layers"),
    "no_heads": ({"n_head": 0}, "number of heads"),
    "layers_text": ({"n_layer": "2"}, "n_layer"),
    "llama_odd_width": ({"model_type": "llama", "hidden_size": 65, "num_attention_heads": 2}, "multiple"),
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
    argv = ["pretrain", "--model_config", str(write_config(tmp_path, change)), "--data_path", str(corpus),
            "--vocab_size", "512", "--cache_dir", str(tmp_path / "cache"), "--output_dir", str(tmp_path / "runs"),
            "--max_length", "64", "--max_steps", "1"]  # fmt: skip
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
