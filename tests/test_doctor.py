"""doctor: the guides' verdict on planted cases, each with the variable and the value to try."""

import json
import time
from pathlib import Path

import pytest
from tiny_tools import one_thread, summary

from conftest import run_cli
from train.config.flags import parse_training_args
from train.data import text as data
from train.run.plan import adapt
from train.tools.doctor import Reading, diagnose


@pytest.fixture(autouse=True)
def _one_thread():
    yield from one_thread()


def run_doctor(capsys, *argv) -> tuple[dict, str]:
    assert run_cli("doctor", "--steps", "8", *argv) == 0
    out = capsys.readouterr().out
    run = next(line for line in out.splitlines() if line.startswith("doctor: /")).split(" ", 1)[1]
    return json.loads((Path(run) / "doctor.json").read_text()), out


def test_sleeping_dataset_is_input_bound_and_workers_cut_the_wait(tiny_flags, monkeypatch, capsys):
    real = data.PackedDataset.__getitem__

    def slow(self, index):
        time.sleep(0.01)  # a slow disk or a heavy transform: 40 ms per micro-batch of 4
        return real(self, index)

    monkeypatch.setattr(data.PackedDataset, "__getitem__", slow)  # forked workers inherit it
    record, out = run_doctor(capsys, "--apply", *tiny_flags, "--batch_size", "4", "--num_workers", "0")
    assert record["verdict"]["kind"] == "input-bound"
    assert record["before"]["data_wait_frac"] >= 0.2
    assert record["try"] == "NUM_WORKERS=2 PERSISTENT_WORKERS=1" and "try: NUM_WORKERS=2" in out
    after = record["after"]
    assert summary(Path(after["run"]))["num_workers"] == 2
    assert after["data_wait_frac"] < record["before"]["data_wait_frac"]
    assert "result: " in out


def test_tiny_batch_on_a_roomy_device_raises_the_batch(tiny_flags, capsys):
    record, out = run_doctor(capsys, *tiny_flags, "--batch_size", "1", "--gradient_accumulation_steps", "4",
                             "--max_memory_mb", "1000000")
    assert record["verdict"]["kind"] == "compute-bound, memory to spare"
    assert record["try"] == "BATCH_SIZE=2 GRADIENT_ACCUM=2"  # the effective batch stays 4
    assert record["before"]["peak_mb"] < 0.7 * record["before"]["capacity_mb"]


def test_memory_cap_near_the_peak_is_memory_bound(tiny_flags, capsys):
    cap = int(adapt._status_mb("VmRSS") * 1.02)  # the process alone nearly fills it
    record, out = run_doctor(capsys, *tiny_flags, "--batch_size", "4", "--max_memory_mb", str(cap))
    assert record["verdict"]["kind"] == "memory-bound"
    assert record["before"]["capacity_source"] == "MAX_MEMORY_MB"
    assert record["try"] == "PRECISION=bf16"  # fp32 on a CPU with bf16 autocast: the first remedy


def test_host_ram_pressure_means_fewer_workers():
    cfg = parse_training_args("pretrain", ["--num_workers", "4", "--device", "cpu"])
    reading = Reading("r", "completed", "fp32", 64, 10.0, 0.5, None, 500.0, 1000.0, "x", 96.0, 0.0)
    verdict = diagnose(reading, cfg)
    assert verdict.kind == "host-RAM pressure" and verdict.changes == {"num_workers": 2}
