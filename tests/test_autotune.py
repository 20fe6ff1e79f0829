"""autotune: real short trials, a ranked table, the winner written as launcher variables and at
least as fast as the OPTIMIZED preset measured on the same machine."""

import re

import pytest
from tiny_tools import one_thread

from conftest import run_cli
from train.tools.autotune import ENV_FILE, preset_candidate


@pytest.fixture(autouse=True)
def _one_thread():
    yield from one_thread()


def test_preset_candidate_keeps_the_effective_batch():
    assert preset_candidate(128, 8).label() == "32 x 4, 4 workers, fp32 (optimized preset)"
    # 32 does not divide 48
    assert preset_candidate(48, 2).label() == "24 x 2, 2 workers, fp32 (optimized preset)"


def test_winner_at_least_as_fast_as_the_preset_and_written_as_variables(tiny_flags, tmp_path, capsys):
    argv = [*tiny_flags, "--batch_size", "4", "--gradient_accumulation_steps", "2"]
    assert run_cli("autotune", "--steps", "1", "--skip", "compile,workers", *argv) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if re.match(r"^\s+\d+\s{2}", line)]
    assert len(rows) >= 4 and rows[0][-1] == "winner"
    rates = [float(row[-6]) for row in rows[1:] if row[-6] != "-"]
    assert rates == sorted(rates, reverse=True)  # the others ranked below the winner
    assert {"fp32", "bf16"} <= {word.strip(",") for row in rows for word in row}  # precisions tried
    preset = next(row for row in rows if "preset)" in row)
    assert float(rows[0][-6]) >= float(preset[-6])  # at least as fast as the OPTIMIZED preset
    assert rows[0] is preset or int(rows[0][-2]) >= 2  # and measured twice, side by side with it
    env = (tmp_path / "runs" / ENV_FILE).read_text().splitlines()
    values = dict(line.split("=", 1) for line in env if not line.startswith("#"))
    assert all(re.fullmatch(r"[A-Z0-9_]+", k) and re.fullmatch(r"[a-z0-9]+", v) for k, v in values.items())
    assert int(values["BATCH_SIZE"]) * int(values["GRADIENT_ACCUM"]) == 8  # the effective batch kept
    assert values["PRECISION"] in ("fp32", "bf16", "fp16")
