"""Reliability fixes of round 5, each on the real path: WARMUP_STEPS=0 makes a checkpoint that
RESUME=1 continues exactly (its meta.json's warmup_samples an int), and a command whose stdout's
reader has gone (`python -m train knobs --markdown | head`) ends quietly with 128 + SIGPIPE."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
from tiny_tools import one_thread

from conftest import ROOT, read_jsonl, run_cli
from train.core.optim.schedules import steps_or_share


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
    # the same run stopped after its step-3 checkpoint
    shutil.copytree(runs / "ref", runs / "cut", symlinks=True)
    shutil.rmtree(runs / "cut" / "checkpoints" / "step-00000006")
    capsys.readouterr()
    assert run_cli("pretrain", *tiny_flags, *run, "--run_name", "cut", "--resume", "1") == 0
    assert "cannot be used" not in capsys.readouterr().out
    assert json.loads((runs / "cut" / "summary.json").read_text())["resumed_from_step"] == 3
    ref, cut = ([r for r in read_jsonl(runs / n / "metrics.jsonl") if "loss" in r] for n in ("ref", "cut"))
    assert [r["step"] for r in cut] == list(range(1, 7))
    assert ref[0]["lr"] == max(r["lr"] for r in ref)  # no warm-up: the first step is at the peak
    assert [r["lr"] for r in cut] == [r["lr"] for r in ref]
    np.testing.assert_allclose([r["loss"] for r in cut[3:]], [r["loss"] for r in ref[3:]], rtol=0, atol=1e-5)


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
