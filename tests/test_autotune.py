"""autotune: real short trials, a ranked table, the winner written as launcher variables and at
least as fast as the OPTIMIZED preset measured on the same machine."""

import re

import pytest
from tiny_tools import one_thread

from conftest import run_cli
from train.autotune import ENV_FILE, preset_candidate


@pytest.fixture(autouse=True)
def _one_thread():
    yield from one_thread()


def test_preset_candidate_keeps_the_effective_batch():
    assert preset_candidate(128, 8).label() == "32 x 4, 4 workers, fp32 (optimized preset)"
    assert preset_candidate(48, 2).label() == "24 x 2, 2 workers, fp32 (optimized preset)"  # 32 does not divide 48


def test_winner_at_least_as_fast_as_the_preset_and_written_as_variables(tiny_flags, tmp_path, capsys):
    argv = [*tiny_flags, "--batch_size", "4", "--gradient_accumulation_steps", "2"]
    assert run_cli("autotune", "--steps", "1", "--skip", "compile,workers", *argv) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if re.match(r"^\s+\d+\s{2}", line)]
    rates = [float(line.split()[-5]) for line in rows if line.split()[-5] != "-"]
    assert len(rows) >= 4 and rates == sorted(rates, reverse=True)  # ranked
    assert {"fp32", "bf16"} <= {word.strip(",") for line in rows for word in line.split()}  # precisions tried
    preset = next(float(line.split()[-5]) for line in rows if "(optimized preset)" in line)
    winner = float(re.search(r"^winner: .*, ([\d.]+) samples/s$", out, re.MULTILINE).group(1))
    assert winner >= preset and rates[0] == winner
    env = (tmp_path / "runs" / ENV_FILE).read_text().splitlines()
    values = dict(line.split("=", 1) for line in env if not line.startswith("#"))
    assert all(re.fullmatch(r"[A-Z0-9_]+", k) and re.fullmatch(r"[a-z0-9]+", v) for k, v in values.items())
    assert int(values["BATCH_SIZE"]) * int(values["GRADIENT_ACCUM"]) == 8  # the effective batch kept
    assert values["PRECISION"] in ("fp32", "bf16", "fp16")
