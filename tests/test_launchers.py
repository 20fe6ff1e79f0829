"""Launchers: variables map to flags one name per knob; a real run through the launcher."""

import json
import shlex

from conftest import launch


def command(script, env, *args):
    result = launch(script, {"SHOW_COMMAND": "1", **env}, *args)
    assert result.returncode == 0, result.stderr
    return shlex.split(result.stdout)


def flag_value(argv, flag):
    return argv[argv.index(flag) + 1]


def test_baseline_defaults_are_the_guides():
    argv = command("run_single_gpu.sh", {})
    assert argv[:4] == ["python", "-m", "train", "pretrain"]
    assert flag_value(argv, "--preset") == "baseline"
    assert flag_value(argv, "--batch_size") == "8"
    assert flag_value(argv, "--gradient_accumulation_steps") == "1"
    assert flag_value(argv, "--num_workers") == "0"
    assert "--fp16" not in argv and "--model_size" not in argv


def test_optimized_defaults_and_overrides():
    argv = command("run_single_gpu_optimized.sh", {})
    assert (flag_value(argv, "--batch_size"), flag_value(argv, "--gradient_accumulation_steps")) == ("32", "4")
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
