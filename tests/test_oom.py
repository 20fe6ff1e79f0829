"""OOM during training: the step is redone with half the micro-batch and twice the accumulation,
the effective batch and the samples trained stay the same; after 3 failures the run stops."""

import pytest
import torch
from safetensors.torch import load_file
from tiny_tools import one_thread, patch_fake_oom, summary

from conftest import read_jsonl, run_cli
from train.run.loop.oom import is_oom, smaller_micro_batch


@pytest.fixture(autouse=True)
def _one_thread():
    yield from one_thread()


def test_oom_is_recognised_for_cuda_hip_and_cpu_but_nothing_else():
    assert is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert torch.cuda.OutOfMemoryError is torch.OutOfMemoryError
    assert is_oom(RuntimeError("HIP error: hipErrorOutOfMemory"))
    assert is_oom(RuntimeError("HIP out of memory. Tried to allocate 1.50 GiB"))
    assert is_oom(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes"))
    assert not is_oom(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)"))
    assert not is_oom(ValueError("out of memory"))  # not a device error


def test_smaller_micro_batch_divides_the_effective_batch():
    assert smaller_micro_batch(8, 16) == 4
    assert smaller_micro_batch(12, 48) == 6
    assert smaller_micro_batch(6, 18) == 3
    assert smaller_micro_batch(5, 15) == 1  # 2 does not divide 15
    assert smaller_micro_batch(1, 4) is None


def test_oom_mid_step_halves_batch_keeps_effective_and_trains_same_samples(tiny_flags, tmp_path, monkeypatch):
    common = [*tiny_flags, "--max_steps", "3", "--seed", "5"]
    assert (
        run_cli(
            "pretrain",
            *common,
            "--batch_size",
            "4",
            "--gradient_accumulation_steps",
            "4",
            "--run_name",
            "ref",
        )
        == 0
    )
    # micro-batches over 4 run out of memory from the 2nd forward on: the 1st micro-step of step 1
    # has already accumulated gradients when the step fails
    calls = patch_fake_oom(monkeypatch, limit=4, from_call=2)
    assert (
        run_cli(
            "pretrain",
            *common,
            "--batch_size",
            "8",
            "--gradient_accumulation_steps",
            "2",
            "--run_name",
            "oom",
        )
        == 0
    )
    runs = tmp_path / "runs"
    s = summary(runs / "oom")
    assert s["oom_retries"] == 1 and s["oom_events"][0]["step"] == 1
    assert (s["batch_size"], s["gradient_accumulation_steps"], s["effective_batch_size"]) == (4, 4, 16)
    assert s["steps"] == 3 and s["samples"] == 48 and s["exit_reason"] == "completed"
    assert calls[:3] == [8, 8, 4]
    assert "out of memory at step 1 with micro-batch 8" in (runs / "oom" / "train.log").read_text()
    # no lost step: the same losses and the same weights as a run that used 4 x 4 from the start
    losses = [
        [row["loss"] for row in read_jsonl(runs / name / "metrics.jsonl") if "loss" in row]
        for name in ("ref", "oom")
    ]
    assert len(losses[1]) == 3
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=0)
    ref, oom = (load_file(runs / name / "final" / "model.safetensors") for name in ("ref", "oom"))
    for key in ref:
        torch.testing.assert_close(oom[key], ref[key], rtol=1e-6, atol=1e-7)


def test_third_oom_stops_with_the_remedies_and_a_saved_model(tiny_flags, tmp_path, monkeypatch):
    patch_fake_oom(monkeypatch, limit=0)  # nothing fits
    argv = [
        *tiny_flags,
        "--batch_size",
        "8",
        "--gradient_accumulation_steps",
        "1",
        "--max_steps",
        "2",
        "--run_name",
        "x",
    ]
    assert run_cli("pretrain", *argv) == 1
    run = tmp_path / "runs" / "x"
    s = summary(run)
    assert s["exit_reason"] == "out_of_memory" and s["steps"] == 0
    assert s["oom_retries"] == 2 and s["batch_size"] == 2 and s["effective_batch_size"] == 8
    lines = [line for line in (run / "train.log").read_text().splitlines() if line.startswith("error:")]
    assert len(lines) == 1
    assert "out of memory 3 time(s)" in lines[0]
    for remedy in ("BATCH_SIZE=1 GRADIENT_ACCUM=8", "PRECISION=bf16", "ENABLE_GRAD_CKPT=1", "MAX_LENGTH="):
        assert remedy in lines[0]
    assert (run / "final" / "model.safetensors").exists()
