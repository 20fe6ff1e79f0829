"""No Python from a user's folder: a tokenizer or model folder (or MODEL_CONFIG) whose auto_map
names its own code is refused in one line naming the variable, exit code 2, with stdin answering
"y" to any prompt, and the payload never runs. The payload is real: trusted, it does run."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, run_cli

PAYLOAD = '''import pathlib
pathlib.Path({marker!r}).write_text("the folder's code ran")
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast


class PayloadTokenizer(PreTrainedTokenizerFast):
    pass


class PayloadConfig(GPT2Config):
    pass


class PayloadModel(GPT2LMHeadModel):
    config_class = PayloadConfig
'''
YES = "y\n" * 200  # what `yes |` feeds: any [y/N] prompt would be answered


@pytest.fixture
def planted(base_model, tmp_path):
    """A copy of a trained final/ whose tokenizer_config.json and config.json name payload.py,
    which creates a marker file when it is imported."""
    folder = tmp_path / "planted"
    shutil.copytree(base_model, folder)
    marker = tmp_path / "marker"
    (folder / "payload.py").write_text(PAYLOAD.format(marker=str(marker)))
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    tok_cfg.update(
        tokenizer_class="PayloadTokenizer", auto_map={"AutoTokenizer": [None, "payload.PayloadTokenizer"]}
    )
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "payload.PayloadConfig", "AutoModelForCausalLM": "payload.PayloadModel"}
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder, marker


def one_error_line(err: str, variable: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"error: {variable}=") and "auto_map" in lines[0], err
    assert "http" not in err and "Traceback" not in err
    return lines[0]


def test_the_payload_runs_when_trusted(planted, tmp_path):
    """The test's payload is live: loaded with trust_remote_code=True it writes the marker, so
    the refusals below would fail if the kit let it load."""
    folder, marker = planted
    code = (
        "from transformers import AutoTokenizer; "
        f"AutoTokenizer.from_pretrained({str(folder)!r}, local_files_only=True, trust_remote_code=True)"
    )
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, timeout=120)
    assert marker.read_text() == "the folder's code ran"


def test_tokenizer_path_with_code_is_refused_by_the_launcher(
    planted, corpus, tiny_config, cache_dir, tmp_path
):
    folder, marker = planted
    env = {"TOKENIZER_PATH": str(folder), "MODEL_CONFIG": str(tiny_config), "DATA_PATH": str(corpus),
           "CACHE_DIR": str(cache_dir), "OUTPUT_DIR": str(tmp_path / "runs"), "MAX_STEPS": "1",
           "HF_HOME": str(tmp_path / "hf")}  # fmt: skip
    base = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR")}
    result = subprocess.run(
        ["bash", str(ROOT / "run_single_gpu.sh")], env={**base, **env}, input=YES, capture_output=True,
        text=True, timeout=300, cwd=ROOT,
    )
    assert result.returncode == 2, result.stderr
    one_error_line(result.stderr, "TOKENIZER_PATH")
    assert not marker.exists() and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("where", ["sft_model", "sft_tokenizer", "model_config", "generate"])
def test_a_folder_with_code_is_refused_in_one_line(
    where, planted, base_model, corpus, tmp_path, capsys, monkeypatch
):
    folder, marker = planted
    monkeypatch.setattr("sys.stdin", io.StringIO(YES))
    runs = ["--output_dir", str(tmp_path / "runs"), "--max_steps", "1"]
    argv, variable, hint = {
        "sft_model": (["sft", "--model_path", str(folder), *runs], "MODEL_PATH", "TRUST_REMOTE_CODE=1"),
        "sft_tokenizer": (
            ["sft", "--model_path", str(base_model), "--tokenizer_path", str(folder), *runs],
            "TOKENIZER_PATH",
            "TRUST_REMOTE_CODE=1",
        ),
        # pretraining has no TRUST_REMOTE_CODE: nothing to suggest
        "model_config": (
            ["pretrain", "--model_config", str(folder / "config.json"), "--data_path", str(corpus), *runs],
            "MODEL_CONFIG",
            "does not run code from a folder",
        ),
        "generate": (
            ["generate", "--model", str(folder), "--prompt", "hi"],
            "--model",
            "--trust_remote_code",
        ),
    }[where]
    assert run_cli(*argv) == 2
    assert hint in one_error_line(capsys.readouterr().err, variable)
    assert not marker.exists() and not (tmp_path / "runs").exists()


def test_every_auto_load_passes_trust_remote_code():
    """transformers prompts on stdin when trust_remote_code is left unset: no Auto* call in the
    kit may leave it so."""
    import re

    calls = re.compile(r"(Auto\w+\.from_(?:pretrained|config)|partial\(AutoModel\w+\.from_pretrained)")
    missing = []
    for path in sorted((ROOT / "train").rglob("*.py")):
        text = path.read_text()
        for match in calls.finditer(text):
            call = text[match.start() : text.find("\n\n", match.start())]
            depth, end = 0, 0
            for i, ch in enumerate(call):
                depth += ch == "("
                depth -= ch == ")"
                if ch == ")" and depth == 0:
                    end = i
                    break
            explicit = "trust_remote_code" in call[: end + 1]
            # an `offline` dict of the keyword arguments, defined with trust_remote_code in it
            shared = "**offline" in call[: end + 1] and re.search(
                r"offline = dict\([^)]*trust_remote_code=", text
            )
            if not (explicit or shared):
                missing.append(f"{path.relative_to(ROOT)}: {call.splitlines()[0]}")
    assert not missing, missing
