"""A newcomer's defaults (issue 28): SFT's default model is the newest completed pretraining run of
a launcher; runs/latest moves only when a run finishes; a plan over the device's memory warns."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

from conftest import ROOT, run_cli, train_python
from train.run.plan.sft_model import choose_pretrained, model_source

TINY_T5 = {
    "model_type": "t5",
    "d_model": 32,
    "d_ff": 64,
    "num_layers": 2,
    "num_decoder_layers": 2,
    "num_heads": 2,
    "d_kv": 16,
    "n_positions": 512,
    "dropout_rate": 0.0,
    "feed_forward_proj": "relu",
    "tie_word_embeddings": True,
}
FAST = ["--batch_size", "4", "--max_steps", "2", "--num_workers", "0"]


def pretrain(flags, name, *extra) -> Path:
    assert run_cli("pretrain", *flags, *FAST, "--run_name", name, *extra) == 0
    return Path(flags[flags.index("--output_dir") + 1]) / name


def age(runs: Path, order: list[str]) -> None:
    """summary.json times in this order, oldest first (a second apart: no tie on a coarse clock)."""
    for i, name in enumerate(order):
        os.utime(runs / name / "summary.json", (1_000_000 + i, 1_000_000 + i))


def source_of(runs: Path) -> tuple[str, str]:
    said = []
    cfg = SimpleNamespace(model=SimpleNamespace(model_path=None), run=SimpleNamespace(output_dir=str(runs)))
    path = model_source(cfg, lambda setting, value, why: said.append(why), said.append)
    return path, " | ".join(said)


def test_sft_default_skips_compare_doctor_unfinished_and_t5_runs(tiny_flags, tmp_path, capsys):
    runs = tmp_path / "runs"
    mine = pretrain(tiny_flags, "mine")  # python -m train pretrain: launcher "train"
    pretrain(tiny_flags, "cmp", "--launcher", "compare-run_single_gpu")  # what compare.sh records
    pretrain(tiny_flags, "doc", "--launcher", "doctor-as-is")
    shutil.copytree(mine, runs / "killed")  # what a SIGKILL leaves: no summary.json, no complete final/
    (runs / "killed" / "summary.json").unlink()
    (runs / "killed" / "final" / ".complete").unlink()
    shutil.copytree(mine, runs / "stopped")  # Ctrl-C: a final/ of what was trained, not a completed run
    summary = json.loads((runs / "stopped" / "summary.json").read_text())
    (runs / "stopped" / "summary.json").write_text(json.dumps({**summary, "exit_reason": "interrupted"}))
    (tmp_path / "t5").mkdir()
    (tmp_path / "t5" / "config.json").write_text(json.dumps(TINY_T5))
    t5_flags = [*tiny_flags, "--model_config", str(tmp_path / "t5"), "--max_length", "32"]
    pretrain(t5_flags, "t5")
    age(runs, ["mine", "cmp", "doc", "stopped", "t5"])
    assert choose_pretrained(runs).final == mine / "final"

    capsys.readouterr()
    argv = [
        "--output_dir",
        str(runs),
        "--max_length",
        "64",
        "--log_every",
        "1",
        "--run_name",
        "chat",
        "--max_steps",
        "1",
    ]
    assert run_cli("sft", *argv, "--batch_size", "4", "--num_workers", "0") == 0
    out = capsys.readouterr()
    text = out.out + out.err
    assert f"model_path = {mine / 'final'}" in text or str(mine / "final") in text, text[-3000:]
    assert f"warning: MODEL_PATH={mine / 'final'} trained only 2 optimizer steps (under 50)" in text
    assert choose_pretrained(runs).final == mine / "final"  # the SFT run is not a pretraining run

    shutil.rmtree(mine)  # the only gpt2 run gone: the T5 run, with a note
    path, said = source_of(runs)
    assert path == str(runs / "t5" / "final")
    assert "note: a t5 model, as no completed causal-LM pretraining run is there" in said
    assert "trained only 2 optimizer steps" in said
    for name in ("t5", "chat"):
        shutil.rmtree(runs / name)
    assert choose_pretrained(runs) is None  # compare, doctor, killed and interrupted runs never count


def test_latest_moves_only_when_a_run_finishes(tiny_flags, tmp_path):
    runs = tmp_path / "runs"
    first = pretrain(tiny_flags, "first")
    assert (runs / "latest").resolve() == first.resolve()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    argv = [train_python(), "-m", "train", "pretrain", *tiny_flags, "--batch_size", "4", "--num_workers", "0",
            "--max_steps", "100000", "--run_name", "killed"]  # fmt: skip
    child = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 180
        metrics = runs / "killed" / "metrics.jsonl"
        while not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
            assert child.poll() is None, child.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the run never logged a step"
            time.sleep(0.2)
        assert (runs / "latest").resolve() == first.resolve()  # in progress: latest stays
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert (runs / "latest").resolve() == first.resolve()  # killed: never finished
    second = pretrain(tiny_flags, "second", "--max_steps", "3")  # stopped by MAX_STEPS: finished
    assert (runs / "latest").resolve() == second.resolve()


def dry(capsys, *argv) -> tuple[int, str]:
    capsys.readouterr()
    code = run_cli("pretrain", "--dry_run", *argv)
    out = capsys.readouterr()
    return code, out.out + out.err


def test_a_dry_run_over_the_memory_warns_and_one_that_cannot_fit_is_refused(tiny_flags, tmp_path, capsys):
    code, text = dry(capsys, *tiny_flags, "--batch_size", "4")
    assert code == 0 and "warning: the memory estimate" not in text
    code, text = dry(capsys, *tiny_flags, "--batch_size", "512", "--max_memory_mb", "64")
    lines = [line for line in text.splitlines() if "warning: the memory estimate" in line]
    assert code == 0 and len(lines) == 1, text[-3000:]
    assert "over the 64 MB this run can use (MAX_MEMORY_MB)" in lines[0] and "warned, not refused" in lines[0]
    # a dry run writes nothing
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
    capsys.readouterr()  # a real start warns the same way and trains
    assert (
        run_cli("pretrain", *tiny_flags, *FAST, "--max_steps", "1", "--max_memory_mb", "1", "--run_name", "r")
        == 0
    )
    out = capsys.readouterr()
    assert "warning: the memory estimate is" in out.out + out.err and "over the 1 MB" in out.out + out.err
    huge = tmp_path / "huge.json"  # ~155B parameters: even one sequence cannot fit this machine
    huge.write_text(
        json.dumps(
            {
                "model_type": "gpt2",
                "n_layer": 48,
                "n_embd": 16384,
                "n_head": 64,
                "n_positions": 64,
                "vocab_size": 512,
            }
        )
    )
    flags = [*tiny_flags]
    flags[flags.index("--model_config") + 1] = str(huge)
    code, text = dry(capsys, *flags)
    assert (
        code == 2
        and "cannot fit" in text.strip().splitlines()[-1]
        and "warning: the memory estimate" not in text
    )


def test_the_cpu_demo_is_eight_steps_of_32_unless_a_budget_is_set(corpus, cache_dir, tmp_path, capsys):
    """No GPU, no MODEL_SIZE, no budget: `make train` is a ~2 minute demo, not 16 steps of 32 x 4."""
    flags = [
        "--data_path",
        str(corpus),
        "--vocab_size",
        "512",
        "--cache_dir",
        str(cache_dir),
        "--output_dir",
        str(tmp_path / "runs"),
        "--device",
        "cpu",
        "--batch_size",
        "32",
        "--gradient_accumulation_steps",
        "4",
    ]
    code, text = dry(capsys, *flags)
    assert code == 0 and "max_samples = 256  (CPU demo budget" in text, text[-3000:]
    assert "gradient_accumulation_steps = 1  (CPU demo" in text and "plan: 8 optimizer steps" in text, text[
        -3000:
    ]
    code, text = dry(capsys, *flags, "--max_steps", "3")
    assert (
        code == 0
        and "CPU demo budget" not in text
        and "GRADIENT_ACCUM 4" in text
        and "plan: 3 optimizer" in text
    )
