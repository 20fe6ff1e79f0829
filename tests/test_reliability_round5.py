"""Reliability fixes of round 5, each on the real path: WARMUP_STEPS=0 makes a checkpoint that
RESUME=1 continues exactly (its meta.json's warmup_samples an int; one written before, 0.0, resumes
too), and a command whose stdout's reader has gone (`python -m train knobs --markdown | head`) ends
quietly with 128 + SIGPIPE, while another pipe's EPIPE is reported and main()'s own code is kept."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
from tiny_tools import one_thread

from conftest import ROOT, read_jsonl, run_cli
from train.core.optim.schedules import steps_or_share
from train.run.checkpoint.on_disk import objective_bytes
from train.run.checkpoint.verify import META_FIELDS, BadCheckpoint, check_meta


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from one_thread()


def test_warmup_steps_0_is_the_int_0_and_a_share_stays_a_share():
    # the flag's float 0.0 reached meta.json as warmup_samples 0.0, which check_meta refuses
    assert steps_or_share(0.0) == 0 and type(steps_or_share(0.0)) is int
    assert steps_or_share(0.05) == 0.05 and steps_or_share(3.0) == 3 and steps_or_share(None) is None


def test_warmup_steps_0_checkpoint_resumes_exactly(tiny_flags, tmp_path, capsys):
    runs = tmp_path / "runs"
    run = ["--batch_size", "4", "--max_steps", "6", "--save_every", "3", "--keep_checkpoints", "5",
           "--seed", "7", "--warmup_steps", "0"]  # fmt: skip
    assert run_cli("pretrain", *tiny_flags, *run, "--run_name", "ref") == 0
    meta = json.loads((runs / "ref" / "checkpoints" / "step-00000003" / "meta.json").read_text())
    assert meta["schedule"]["warmup_samples"] == 0 and type(meta["schedule"]["warmup_samples"]) is int
    # the same run stopped after its step-3 checkpoint, written before the fix: warmup_samples 0.0
    shutil.copytree(runs / "ref", runs / "cut", symlinks=True)
    shutil.rmtree(runs / "cut" / "checkpoints" / "step-00000006")
    old = runs / "cut" / "checkpoints" / "step-00000003" / "meta.json"
    meta["schedule"]["warmup_samples"] = 0.0
    old.write_text(json.dumps(meta))
    assert '"warmup_samples": 0.0' in old.read_text()
    capsys.readouterr()
    assert run_cli("pretrain", *tiny_flags, *run, "--run_name", "cut", "--resume", "1") == 0
    assert "cannot be used" not in capsys.readouterr().out
    assert json.loads((runs / "cut" / "summary.json").read_text())["resumed_from_step"] == 3
    ref, cut = ([r for r in read_jsonl(runs / n / "metrics.jsonl") if "loss" in r] for n in ("ref", "cut"))
    assert [r["step"] for r in cut] == list(range(1, 7))
    assert ref[0]["lr"] == max(r["lr"] for r in ref)  # no warm-up: the first step is at the peak
    assert [r["lr"] for r in cut] == [r["lr"] for r in ref]
    np.testing.assert_allclose([r["loss"] for r in cut[3:]], [r["loss"] for r in ref[3:]], rtol=0, atol=1e-5)


def test_check_meta_takes_an_integer_valued_float_as_its_int_and_refuses_other_numbers():
    def made(kinds: dict) -> dict:  # a meta.json check_meta takes: 1 for an int, {} for a dict
        return {k: made(v) if isinstance(v, dict) else {} if v is dict else 1 for k, v in kinds.items()}

    def meta(warmup) -> dict:
        return made(META_FIELDS) | {"schedule": {"unit_samples": 1, "warmup_samples": warmup,
                                                 "budget_samples": 8}}  # fmt: skip

    for value in (0.0, 128.0):
        checked = meta(value)
        check_meta(checked)
        warmup = checked["schedule"]["warmup_samples"]
        assert warmup == value and type(warmup) is int
    for value in (1.5, float("nan"), float("inf"), -2.0, True, "0"):
        with pytest.raises(BadCheckpoint, match="schedule.warmup_samples"):
            check_meta(meta(value))


def test_the_free_space_check_counts_each_ranks_objective_state_once():
    # under DDP state.pt's "objective" is objective_ranks[0] again: torch.save writes it once
    first, second = ({"cached": [torch.zeros(n, 4)]} for n in (10, 6))
    one_rank = {"objective": first}
    assert objective_bytes(one_rank) == 10 * 4 * 4
    assert objective_bytes({"objective": first, "objective_ranks": [first, second]}) == 16 * 4 * 4
    assert objective_bytes({"optimizer": {}}) == 0


def test_a_command_whose_reader_has_gone_ends_quietly():
    """`... | head` closes the pipe early; here it is closed before the first line: every write fails."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run([sys.executable, "-m", "train", "knobs", "--markdown"], cwd=ROOT, stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=120)  # fmt: skip
    finally:
        os.close(write)
    assert proc.stderr == ""  # was a BrokenPipeError traceback, or "Exception ignored ... BrokenPipeError"
    assert proc.returncode == 128 + signal.SIGPIPE  # what the shell reports for a tool SIGPIPE ended


def cli_with(main: str, stdout) -> subprocess.CompletedProcess:
    """`python -m train` (its __main__ block) with main() replaced by `main`'s code."""
    code = (f"import os, sys, runpy, train.cli\ndef main():\n{main}\ntrain.cli.main = main\n"
            "runpy.run_module('train', run_name='__main__')")  # fmt: skip
    # stdout block-buffered, as a command's is in a pipe: main()'s lines reach the pipe at run()'s flush
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, stdout=stdout, stderr=subprocess.PIPE,
                          text=True, timeout=120, env=env)  # fmt: skip


def test_a_broken_pipe_that_is_not_stdout_is_reported():
    """A worker's or a subprocess's pipe whose reader went is a fault: its traceback, not a quiet 141."""
    body = "    read, write = os.pipe()\n    os.close(read)\n    os.write(write, b'x')\n    return 0"
    proc = cli_with(body, subprocess.PIPE)
    assert "BrokenPipeError" in proc.stderr and ", in main" in proc.stderr  # where it came from
    assert proc.returncode == 1


def test_main_s_own_code_stays_when_stdout_s_reader_has_gone_too():
    read, write = os.pipe()
    os.close(read)
    try:
        failed = cli_with("    print('half a table')\n    return 2", write)
        done = cli_with("    print('the whole table')\n    return 0", write)
    finally:
        os.close(write)
    assert (failed.returncode, failed.stderr) == (2, "")
    assert (done.returncode, done.stderr) == (128 + signal.SIGPIPE, "")
