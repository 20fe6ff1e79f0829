"""Launchers: variables map to flags one name per knob; a real run through the launcher."""

import json
import shlex

import pytest

from conftest import KIT_PY, launch


def command(script, env, *args):
    result = launch(script, {"SHOW_COMMAND": "1", **env}, *args)
    assert result.returncode == 0, result.stderr
    return shlex.split(result.stdout)


def flag_value(argv, flag):
    return argv[argv.index(flag) + 1]


def test_baseline_defaults_are_the_guides():
    argv = command("run_single_gpu.sh", {})
    assert argv[:4] == [KIT_PY, "-m", "train", "pretrain"]
    assert flag_value(argv, "--preset") == "baseline"
    assert flag_value(argv, "--batch_size") == "8"
    assert flag_value(argv, "--gradient_accumulation_steps") == "1"
    assert flag_value(argv, "--num_workers") == "0"
    assert "--fp16" not in argv and "--model_size" not in argv


def test_optimized_defaults_and_overrides():
    argv = command("run_single_gpu_optimized.sh", {})
    assert (flag_value(argv, "--batch_size"), flag_value(argv, "--gradient_accumulation_steps")) == (
        "32",
        "4",
    )
    assert flag_value(argv, "--num_workers") == "4"
    env = {
        "MODEL_SIZE": "medium",
        "BATCH_SIZE": "16",
        "GRADIENT_ACCUM": "8",
        "ENABLE_FP16": "--fp16",
        "ENABLE_GRAD_CKPT": "1",
        "MAX_LENGTH": "512",
        "DATA_PATH": "my data/with space.txt",
        "LEARNING_RATE": "3e-4",
    }
    argv = command("run_single_gpu_optimized.sh", env, "--seed", "7")
    assert flag_value(argv, "--model_size") == "medium"
    assert flag_value(argv, "--batch_size") == "16"
    assert flag_value(argv, "--gradient_accumulation_steps") == "8"
    assert "--fp16" in argv and "--gradient_checkpointing" in argv
    assert flag_value(argv, "--max_length") == "512"
    assert flag_value(argv, "--data_path") == "my data/with space.txt"
    assert flag_value(argv, "--learning_rate") == "3e-4"
    assert argv[-2:] == ["--seed", "7"]  # "$@" passed last: a flag can be added by hand


def test_switch_accepts_guides_form_and_numbers():
    assert "--bf16" in command("run_single_gpu.sh", {"ENABLE_BF16": "1"})
    assert "--bf16" in command("run_single_gpu.sh", {"ENABLE_BF16": "--bf16"})
    assert "--bf16" not in command("run_single_gpu.sh", {"ENABLE_BF16": "0"})


def test_optimized_launcher_trains_end_to_end(tmp_path, corpus, tiny_config, cache_dir):
    env = {
        "MODEL_CONFIG": str(tiny_config),
        "DATA_PATH": str(corpus),
        "VOCAB_SIZE": "512",
        "CACHE_DIR": str(cache_dir),
        "OUTPUT_DIR": str(tmp_path / "runs"),
        "RUN_NAME": "x",
        "MAX_LENGTH": "64",
        "BATCH_SIZE": "4",
        "GRADIENT_ACCUM": "2",
        "NUM_WORKERS": "2",
        "MAX_STEPS": "6",
        "LOG_EVERY": "2",
    }
    result = launch("run_single_gpu_optimized.sh", env)
    assert result.returncode == 0, result.stderr[-2000:]
    run = tmp_path / "runs" / "x"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["batch_size"] == 4 and summary["gradient_accumulation_steps"] == 2
    assert summary["effective_batch_size"] == 8 and summary["num_workers"] == 2
    assert summary["steps"] == 6 and summary["exit_reason"] == "completed"
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["config"]["run"]["launcher"] == "run_single_gpu_optimized"
    assert cfg["config"]["data"]["persistent_workers"] is True
    assert (tmp_path / "runs" / "latest").resolve() == run.resolve()


def warnings_of(script, env, *args):
    result = launch(script, {"SHOW_COMMAND": "1", **env}, *args)
    assert result.returncode == 0, result.stderr  # a warning, not a stop
    return result.stderr.splitlines(), shlex.split(result.stdout)


@pytest.mark.parametrize(
    "script",
    ["run_single_gpu.sh", "run_single_gpu_optimized.sh", "train_sft_custom.sh", "quick_start_sft_fast.sh"],
)
def test_misspelled_variable_is_named_with_the_right_one(script):
    lines, argv = warnings_of(script, {"BACH_SIZE": "3"})
    assert lines == ["warning: BACH_SIZE is not a variable of this kit; did you mean BATCH_SIZE?"]
    assert flag_value(argv, "--batch_size") != "3"  # ignored, as the warning says


def test_near_misses_of_every_kind():
    env = {
        "BACTH_SIZE": "1",  # neighbours swapped
        "LEARING_RATE": "1",  # a letter missing
        "EPOCH": "1",  # short name, one letter off
        "SIZE_BATCH": "1",  # the same letters
        "GRADIENT_ACCUMULATION_STEPS": "2",  # the flag's name
        "FP16": "1",  # the flag of a switch
        "NPROC_PER_NOD": "2",  # a variable outside the knob lists
    }
    lines, _ = warnings_of("run_single_gpu.sh", env)
    suggested = dict(
        line.removeprefix("warning: ").split(" is not a variable of this kit; did you mean ")
        for line in lines
    )
    assert suggested == {
        "BACTH_SIZE": "BATCH_SIZE?",
        "LEARING_RATE": "LEARNING_RATE?",
        "EPOCH": "EPOCHS?",
        "SIZE_BATCH": "BATCH_SIZE?",
        "GRADIENT_ACCUMULATION_STEPS": "GRADIENT_ACCUM?",
        "FP16": "ENABLE_FP16?",
        "NPROC_PER_NOD": "NPROC_PER_NODE?",
    }


def test_no_warning_for_known_or_unrelated_variables():
    env = {
        # the kit's own names, spelled right
        "BATCH_SIZE": "4", "NPROC_PER_NODE": "1", "SHOW_COMMAND": "1", "TF32": "1", "SEED": "1",
        # other tools' names, some a couple of letters from a knob (LANG/RANK, USER/SEED,
        # NODE_PATH/MODEL_PATH)
        "USER": "me", "SHELL": "/bin/bash", "TERM": "xterm", "PWD": "/", "CUDA_VISIBLE_DEVICES": "0",
        "OMP_NUM_THREADS": "1", "HF_HOME": "/tmp", "PYTHONPATH": "/x", "NODE_PATH": "/n", "LOCAL_SIZE": "1",
        "VIRTUAL_ENV": "/v", "MAKEFLAGS": "-j", "SLURM_NNODES": "1", "batch_sise": "lower case: not ours",
    }  # fmt: skip
    lines, _ = warnings_of("run_single_gpu_optimized.sh", env)
    assert lines == []


def test_names_checked_once_per_command():
    # make compare runs both launchers under one check: the child launchers see the marker.
    lines, _ = warnings_of("run_single_gpu.sh", {"BACH_SIZE": "3", "KIT_NAMES_CHECKED": "1"})
    assert lines == []
    lines, _ = warnings_of("scripts/kit.sh", {"BACH_SIZE": "3"}, "find-batch")
    assert len(lines) == 1 and "BACH_SIZE" in lines[0]
