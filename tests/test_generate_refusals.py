"""`python -m train generate` and GENERATION_CONFIG against hostile input (issue 37): flags and a
folder's generation_config.json that transformers would fail on with a traceback (or gigabytes),
FIFOs and devices where a file is expected, JSON nested 100,000 deep, a chat template that loops:
each one line, exit code 2, in bounded time; and piped chat input shows where each reply starts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from conftest import ROOT, run_cli, train_python

DEEP = "[" * 100_000 + "]" * 100_000
TOOLS_TEMPLATE = "{{ tools | tojson }}{% for m in messages %}{{ m['content'] }}{% endfor %}"


def one_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:"), err
    return err[0]


def run(*argv: str, stdin: str = "", timeout: int = 120) -> subprocess.CompletedProcess:
    """A subprocess, for what could hang: a hang fails by the timeout instead."""
    return subprocess.run([train_python(), "-m", "train", *argv], cwd=ROOT, capture_output=True, text=True,
                          input=stdin, timeout=timeout)  # fmt: skip


@pytest.mark.parametrize("flags,named", [
    (["--num_beams", "1000000"], "--num_beams"),
    (["--device", "bogus"], "--device"),
    (["--temperature", "nan"], "--temperature"),
    (["--seed", str(2**70)], "--seed"),
])  # fmt: skip
def test_bad_flags_are_one_line(base_model, capsys, flags, named):
    assert run_cli("generate", "--model", str(base_model), "--prompt", "Hi", *flags) == 2
    assert named in one_error(capsys)


@pytest.fixture
def folder(base_model, tmp_path):
    copy = tmp_path / "final"
    shutil.copytree(base_model, copy)
    return copy


@pytest.mark.parametrize(
    "settings,named",
    [
        ({"forced_eos_token_id": 99999}, "forced_eos_token_id: 99999 is outside the model's"),
        ({"bad_words_ids": 5}, "bad_words_ids: expected token ids"),
        ({"bad_words_ids": [[1, "x"]]}, "bad_words_ids: expected token ids"),
        ({"eos_token_id": [1, "a"]}, "eos_token_id: expected token ids"),
        (
            {"penalty_alpha": 0.6, "top_k": 4},
            "penalty_alpha: contrastive search runs as code fetched from the Hub",
        ),
        (
            {"do_sample": True, "num_return_sequences": 100_000_000},
            "num_return_sequences: expected a whole number from 1",
        ),
    ],
)
def test_a_bad_generation_config_json_is_one_line(folder, capsys, settings, named):
    saved = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**saved, **settings}))
    assert run_cli("generate", "--model", str(folder), "--prompt", "Hi", "--max_new_tokens", "2") == 2
    err = one_error(capsys)
    assert f"--model {folder}: generation_config.json's {named}" in err, err


def with_template(folder, template: str) -> None:
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))


def test_json_nested_100k_deep_is_one_line(folder, tmp_path, capsys):
    with_template(folder, TOOLS_TEMPLATE)
    tools = tmp_path / "tools.json"
    tools.write_text(DEEP)
    assert run_cli("generate", "--model", str(folder), "--prompt", "Hi", "--tools", str(tools)) == 2
    assert one_error(capsys).startswith("error: --tools: 'tools' nested too deep")
    (folder / "tokenizer_config.json").write_text('{"a": ' + DEEP + "}")
    assert run_cli("generate", "--model", str(folder), "--prompt", "Hi") == 2
    assert one_error(capsys) == f"error: --model {folder}: tokenizer_config.json is nested too deep to read"


def test_a_fifo_or_device_in_the_model_folder_or_as_tools_is_one_line(folder, tmp_path):
    with_template(folder, TOOLS_TEMPLATE)
    fifo = tmp_path / "tools.json"
    os.mkfifo(fifo)
    done = run("generate", "--model", str(folder), "--prompt", "Hi", "--tools", str(fifo))
    assert done.returncode == 2 and done.stderr.strip() == (f"error: --tools: {fifo} is a FIFO, not a "
                                                            f"regular file; name a file")
    (folder / "generation_config.json").unlink()
    os.mkfifo(folder / "generation_config.json")
    done = run("generate", "--model", str(folder), "--prompt", "Hi")
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (f"error: --model {folder}: generation_config.json is a FIFO, not a "
                                   f"regular file")


def test_a_chat_template_that_loops_is_one_line(folder):
    with_template(folder, "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    done = run("generate", "--model", str(folder), "--prompt", "Hi", "--max_new_tokens", "2")
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (f"error: --model {folder}: its chat template cannot render the chat: it "
                                   f"runs past 3 s (a loop without end?)")  # fmt: skip


def test_piped_chat_shows_the_prompt_and_where_the_reply_starts(base_model):
    done = run(
        "generate", "--model", str(base_model), "--max_new_tokens", "3", "--greedy", stdin="Hello\nAgain\n"
    )
    assert done.returncode == 0, done.stderr
    assert "you> Hello\nmodel> " in done.stderr and "you> Again\nmodel> " in done.stderr, done.stderr
    assert len(done.stdout.strip().splitlines()) <= 2 and "you>" not in done.stdout  # the replies alone


@pytest.mark.parametrize("settings,named", [
    ({"bad_words_ids": [[99999]]}, "bad_words_ids [[99999]] is outside the model's"),
    ({"suppress_tokens": [99999]}, "suppress_tokens [99999] is outside the model's"),
    ({"num_beams": 1_000_000}, "num_beams"),
    ({"do_sample": True, "num_return_sequences": 100_000_000}, "num_return_sequences"),
    ({"eos_token_id": [1, "a"]}, "eos_token_id"),
    ({"penalty_alpha": 0.6, "top_k": 4}, "penalty_alpha"),
    ({"a": json.loads("[" * 900 + "]" * 900)}, "'a'"),
])  # fmt: skip
def test_generation_config_is_refused_before_any_run_folder(tiny_flags, tmp_path, capsys, settings, named):
    path = tmp_path / "gen.json"
    path.write_text(json.dumps(settings))
    capsys.readouterr()
    assert run_cli("pretrain", *tiny_flags, "--max_steps", "1", "--generation_config", str(path)) == 2
    err = one_error(capsys)
    assert err.startswith("error: GENERATION_CONFIG (--generation_config)") and named in err, err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("kind", ["fifo", "device", "deep"])
def test_generation_config_that_is_no_file_is_one_line(tiny_flags, tmp_path, kind):
    path = tmp_path / "gen.json"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "deep":
        path.write_text(DEEP)
    done = run("pretrain", *tiny_flags, "--max_steps", "1", "--generation_config",
               "/dev/zero" if kind == "device" else str(path))  # fmt: skip
    errors = [line for line in done.stderr.splitlines() if line.startswith("error")]
    assert done.returncode == 2 and len(errors) == 1 and "GENERATION_CONFIG" in errors[0], done.stderr
    assert ("nested too deep" if kind == "deep" else "not a regular file") in errors[0], errors
    assert not (tmp_path / "runs").exists()
