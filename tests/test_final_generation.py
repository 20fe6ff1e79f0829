"""final/ generates at full speed with plain transformers generate() (the KV cache on in
config.json and generation_config.json), and `python -m train generate` on a folder without a
tokenizer is one line naming the folder."""

from __future__ import annotations

import json
import shutil

from conftest import run_cli


def test_final_loads_with_the_kv_cache_on(base_model):
    from transformers import AutoModelForCausalLM

    # training turns the cache off on the model; what is saved must have it on
    assert json.loads((base_model / "generation_config.json").read_text())["use_cache"] is True
    model = AutoModelForCausalLM.from_pretrained(base_model, local_files_only=True)
    assert model.config.use_cache is True and model.generation_config.use_cache is True


def test_generate_turns_the_cache_on_for_an_older_final(base_model, tmp_path):
    """A final/ saved before the fix (generation_config.json with use_cache false) still
    generates with the cache through `python -m train generate` / make chat."""
    from train.tools.generate import load

    old = tmp_path / "old"
    shutil.copytree(base_model, old)
    gen = json.loads((old / "generation_config.json").read_text())
    (old / "generation_config.json").write_text(json.dumps({**gen, "use_cache": False}))
    model, _, _ = load(str(old), "cpu", trust_remote_code=False)
    assert model.generation_config.use_cache is True


def test_generate_without_tokenizer_files_is_one_line(base_model, tmp_path, capsys):
    folder = tmp_path / "final"
    folder.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(base_model / name, folder / name)
    assert run_cli("generate", "--model", str(folder), "--prompt", "hi") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"error: --model {folder}") and "tokenizer" in err, (
        err
    )


def test_generate_of_an_empty_prompt_is_one_line(base_model, capsys):
    assert run_cli("generate", "--model", str(base_model), "--prompt", "") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: --prompt") and "Traceback" not in "\n".join(err)
