"""A run's life from a new user's and a hostile probe's view (issue 37), on tiny real models: a
run whose weights end non-finite writes no final/ and does not become runs/latest; runs/latest
never names an interrupted run; `python -m train import` refuses NaN, integer and complex
weights and a DEST it cannot make in one line; a MODEL_PATH holding NaN is refused at load."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_sft_data import make_tokenizer

from conftest import ROOT, launch, read_jsonl, run_cli
from conftest import launcher_env as clean_launcher_env

GPT = {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "n_positions": 64, "vocab_size": 448}


def launcher_env(corpus, tiny_config, cache_dir, runs: Path, **more) -> dict:
    env = {
        "MODEL_CONFIG": str(tiny_config),
        "DATA_PATH": str(corpus),
        "VOCAB_SIZE": "512",
        "CACHE_DIR": str(cache_dir),
        "OUTPUT_DIR": str(runs),
        "MAX_LENGTH": "64",
        "BATCH_SIZE": "4",
    }
    env.update({k: str(v) for k, v in more.items()})
    return env


def summary_of(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def test_non_finite_weights_are_never_final_nor_latest(corpus, tiny_config, cache_dir, tmp_path):
    """Fewer non-finite steps than NAN_PATIENCE and no validation pass to see them: the run used to
    end 'completed' (exit 0) with a final/ of NaN weights that became runs/latest."""
    runs = tmp_path / "runs"
    # a misspelled knob: the warning of the first line is said again at the end (it scrolled away)
    good = launch(
        "run_single_gpu.sh",
        launcher_env(corpus, tiny_config, cache_dir, runs, MAX_STEPS=2, RUN_NAME="good", BACTH_SIZE=2),
    )
    assert good.returncode == 0, good.stderr
    warning = "warning: BACTH_SIZE is not a variable of this kit; did you mean BATCH_SIZE?"
    assert good.stderr.splitlines()[0] == warning
    assert good.stdout.splitlines()[-1] == warning + " (so it had no effect on this run)"
    assert os.readlink(runs / "latest") == "good"
    env = launcher_env(corpus, tiny_config, cache_dir, runs, MAX_STEPS=3, RUN_NAME="nan", LEARNING_RATE="1e6",
                       VAL_FRACTION=0, NAN_PATIENCE=5)  # fmt: skip
    bad = launch("run_single_gpu.sh", env)
    out = bad.stdout + bad.stderr
    assert bad.returncode == 1, out
    summary = summary_of(runs / "nan")
    assert summary["exit_reason"] == "non_finite_weights" and summary["non_finite_steps"] >= 1
    assert "stopping: the weights are non-finite" in out and "no final/ written" in out
    assert not (runs / "nan" / "final").exists() and not (runs / "nan" / "best").exists()
    assert os.readlink(runs / "latest") == "good"  # runs/latest did not move


def test_interrupted_run_is_never_latest(corpus, tiny_config, cache_dir, tmp_path):
    """Ctrl+C: exit 130, exit_reason interrupted, final/ of the step; runs/latest stays where it was
    (the README: it moves only when a run completes)."""
    runs = tmp_path / "runs"
    assert (
        run_cli(
            "pretrain",
            "--model_config",
            str(tiny_config),
            "--data_path",
            str(corpus),
            "--vocab_size",
            "512",
            "--cache_dir",
            str(cache_dir),
            "--output_dir",
            str(runs),
            "--max_length",
            "64",
            "--batch_size",
            "4",
            "--max_steps",
            "1",
            "--run_name",
            "done",
        )
        == 0
    )
    env = launcher_env(corpus, tiny_config, cache_dir, runs, MAX_STEPS=10000, RUN_NAME="cut", LOG_EVERY=1)
    proc = start_launcher(env)
    wait_for_rows(runs / "cut" / "metrics.jsonl", 2, proc)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert summary_of(runs / "cut")["exit_reason"] == "interrupted"
    assert os.readlink(runs / "latest") == "done"


def start_launcher(env: dict, script: str = "run_single_gpu.sh") -> subprocess.Popen:
    return subprocess.Popen(["bash", str(ROOT / script)], env=clean_launcher_env(env), cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip


def wait_for_rows(metrics: Path, n: int, proc: subprocess.Popen, limit: float = 240) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the run ended early: {proc.communicate()}")
        if metrics.exists() and len(metrics.read_text().splitlines()) >= n:
            return
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("no metrics rows in time")


# ---- python -m train import, MODEL_PATH --------------------------------------------------------


def bare(folder: Path, change=None) -> Path:
    """A bare GPT-2 state_dict (torch.save) beside its config.json and a tokenizer; change(weights)
    spoils it."""
    from transformers import GPT2Config, GPT2LMHeadModel

    folder.mkdir()
    torch.manual_seed(0)
    weights = GPT2LMHeadModel(GPT2Config(**{k: v for k, v in GPT.items() if k != "model_type"})).state_dict()
    if change:
        change(weights)
    torch.save(weights, folder / "weights.bin")
    (folder / "config.json").write_text(json.dumps(GPT))
    make_tokenizer().save_pretrained(folder)
    return folder


def _nan(w):
    w["transformer.h.1.mlp.c_fc.weight"][0, 3] = float("nan")


def _inf(w):
    w["lm_head.weight"][2, 2] = float("inf")


def _int64(w):
    w["transformer.wpe.weight"] = w["transformer.wpe.weight"].to(torch.int64)


def _complex(w):
    w["transformer.h.0.attn.c_attn.bias"] = w["transformer.h.0.attn.c_attn.bias"].to(torch.complex64)


SPOILED = {
    "nan": (_nan, "transformer.h.1.mlp.c_fc.weight holds 1 non-finite value(s)"),
    "inf": (_inf, "holds 1 non-finite value(s)"),  # lm_head is tied to wte: either name
    "int64": (_int64, "transformer.wpe.weight is int64, not a floating-point tensor"),
    "complex": (_complex, "transformer.h.0.attn.c_attn.bias is complex64, not a floating-point tensor"),
}


@pytest.mark.parametrize("case", list(SPOILED))
def test_import_refuses_spoiled_weights_in_one_line(case, tmp_path, capsys):
    change, expect = SPOILED[case]
    src = bare(tmp_path / "src", change)
    assert run_cli("import", str(src), str(tmp_path / "dest")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: SRC: weights.bin: ") and expect in err, err
    assert not (tmp_path / "dest").exists() and not list(tmp_path.glob(".dest*"))


def test_import_dest_it_cannot_make_is_one_line(tmp_path, capsys):
    src = bare(tmp_path / "src")
    (tmp_path / "file").write_text("a regular file")
    for dest, expect in ((tmp_path / "file" / "dest", "is a file, not a folder"),
                         (Path("/proc/kit-import-test/dest"), "no folder can be made there")):  # fmt: skip
        assert run_cli("import", str(src), str(dest)) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"error: DEST={dest}: " in err and expect in err, err
    assert run_cli("import", str(src), str(tmp_path / "ok")) == 0  # the same SRC imports fine


def test_model_path_with_a_nan_tensor_is_refused_at_load(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    src = bare(tmp_path / "src")
    assert run_cli("import", str(src), str(tmp_path / "hf")) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    with torch.no_grad():
        model.transformer.h[0].ln_1.weight[5] = float("nan")
    model.save_pretrained(tmp_path / "hf")
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}?", "response": f"{i}."}) + "\n" for i in range(16)))
    runs = tmp_path / "runs"
    capsys.readouterr()  # transformers' own loading bars above
    assert (
        run_cli(
            "sft",
            "--model_path",
            str(tmp_path / "hf"),
            "--data_path",
            str(data),
            "--output_dir",
            str(runs),
            "--cache_dir",
            str(tmp_path / "cache"),
            "--max_steps",
            "1",
            "--max_length",
            "32",
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"MODEL_PATH={tmp_path / 'hf'}" in err, err
    assert "transformer.h.0.ln_1.weight holds 1 non-finite value(s)" in err
    assert not runs.exists()


# ---- RESUME=1 keeps the run's own settings --------------------------------------------------


def test_the_printed_resume_command_continues_the_run_as_it_was(corpus, tiny_config, cache_dir, tmp_path):
    """Ctrl+C, then the command the run printed, run as it is (no other variable): the same run
    length and settings, and the same losses step for step (20) as a run never interrupted. It once
    planned the CPU demo's 256 samples instead of MAX_STEPS and stopped early, 'completed'."""
    runs = tmp_path / "runs"
    env = launcher_env(corpus, tiny_config, cache_dir, runs, MAX_STEPS=20, LOG_EVERY=1, OMP_NUM_THREADS=1)
    reference = launch("run_single_gpu.sh", {**env, "RUN_NAME": "whole"})
    assert reference.returncode == 0, reference.stderr
    eta = [
        x for x in reference.stdout.splitlines() if x.startswith("about ")
    ]  # after the warm-up steps, once
    assert len(eta) == 1 and re.fullmatch(r"about \d+\.\d\d s per step on this machine \(the first 2 "
                                          r"steps\), "
                                          r"18 steps to go: ETA \d+:\d\d", eta[0]), eta  # fmt: skip
    proc = start_launcher({**env, "RUN_NAME": "cut"})
    wait_for_rows(runs / "cut" / "metrics.jsonl", 3, proc)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    cut = summary_of(runs / "cut")["steps"]
    assert cut < 20
    line = next(x for x in (out + err).splitlines() if x.startswith("interrupted: to continue"))
    command = re.fullmatch(r"interrupted: to continue from the last checkpoint, run (.*) "
                           r"\./run_single_gpu\.sh "
                           r"\(its other settings are kept\)", line)  # fmt: skip
    assert command, line
    assigned = dict(item.split("=", 1) for item in shlex.split(command.group(1)))
    assert assigned == {"RESUME": "1", "RUN_NAME": "cut", "OUTPUT_DIR": str(runs), "BATCH_SIZE": "4"}
    resumed = launch("run_single_gpu.sh", {**assigned, "OMP_NUM_THREADS": "1"})
    text = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, text
    assert "changed since the checkpoint" not in text
    taken = next(
        x for x in text.splitlines() if x.startswith("RESUME=1: settings not given again are cut's own: ")
    )
    assert "MAX_STEPS=20" in taken.split() and f"MODEL_CONFIG={tiny_config}" in taken.split()
    summary = summary_of(runs / "cut")
    assert (summary["exit_reason"], summary["steps"], summary["resumed_from_step"]) == ("completed", 20, cut)
    rows = [r for r in read_jsonl(runs / "cut" / "metrics.jsonl") if "loss" in r]
    whole = [r for r in read_jsonl(runs / "whole" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, 21)) == [r["step"] for r in whole]
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in whole], abs=1e-5)
    assert os.readlink(runs / "latest") == "cut"  # completed now


def test_python_m_train_without_torch_is_one_line():
    """`python -m train` with a Python that lacks the kit's packages (outside .venv): one line naming
    .venv/bin/python and make setup, not a 12-line ModuleNotFoundError traceback."""
    bare = subprocess.run(
        [sys.executable, "-S", "-m", "train", "pretrain", "--max_steps", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": os.environ["PATH"]},
    )
    assert bare.returncode == 2 and not bare.stdout
    assert (
        bare.stderr.startswith("error: torch is not installed in this Python (")
        and len(bare.stderr.splitlines()) == 1
    )
    assert ".venv/bin/python -m train" in bare.stderr and "make setup" in bare.stderr


LLAMA = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "vocab_size": 512,
}


def llama_run(tmp_path, corpus, cache_dir, name: str, **change) -> list[str]:
    config = tmp_path / f"{name}.json"
    config.write_text(json.dumps({**LLAMA, **change}))
    return ["--model_config", str(config), "--data_path", str(corpus), "--vocab_size", "512", "--cache_dir",
            str(cache_dir), "--output_dir", str(tmp_path / "runs"), "--max_length", "64", "--batch_size", "4",
            "--max_steps", "3", "--val_fraction", "0", "--run_name", name]  # fmt: skip


def test_settings_final_cannot_save_are_refused_before_training(tmp_path, corpus, cache_dir, capsys):
    """A MODEL_CONFIG whose generation settings transformers refuses to save (pad_token_id -5) once
    trained the whole run and then failed at the save: no final/, no summary.json."""
    argv = llama_run(tmp_path, corpus, cache_dir, "pad", pad_token_id=-5)
    assert run_cli("pretrain", *argv) == 2
    err = [x for x in capsys.readouterr().err.splitlines() if not x.startswith("[transformers]")]
    assert len(err) == 1 and err[0].startswith(f"error: MODEL_CONFIG={tmp_path / 'pad.json'}: final/ could "
                                               f"not be "), err
    assert "pad_token_id" in err[0] and "-5" in err[0]
    assert not (tmp_path / "runs").exists()


def test_a_config_that_trains_nan_ends_non_finite(tmp_path, corpus, cache_dir, capsys):
    """rms_norm_eps -1 (the square root of a negative mean in every norm; rope_theta -1 did this before
    it was refused in one line): every loss NaN from the first step, fewer steps than NAN_PATIENCE."""
    assert run_cli("pretrain", *llama_run(tmp_path, corpus, cache_dir, "rope", rms_norm_eps=-1.0)) == 1
    run = tmp_path / "runs" / "rope"
    assert summary_of(run)["exit_reason"] == "non_finite_weights" and not (run / "final").exists()
    assert not (tmp_path / "runs" / "latest").exists()
