"""COMPILE and COMPILE_MODE as the plan decides them: empty COMPILE is on for a CUDA device and off
on a CPU (a real CPU run says so in config.json), a value the user sets wins; empty COMPILE_MODE
is reduce-overhead (CUDA graphs) for the GPU table's launch-bound paths (SFT, DPO, T5 on an H200)
and default where a micro-batch's math hides the launches, several processes, packed rows or an
unknown peak. CUDA graphs' gradients, kept out of the graphs' pool, train as the usual ones do
(the graphs themselves need a GPU: scripts/gpu_report.sh measures them)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

from config import OptimConfig, resolve
from conftest import run_cli, tiny_model
from train.core.measure.mfu import peak_flops
from train.core.optim.registry import build_optimizer
from train.core.step import train_step
from train.models import FAMILIES
from train.models.build import build_config
from train.models.family import CAUSAL_LM
from train.run.compile import wrapper
from train.run.compile.choose import LAUNCH_BOUND_MS, choose_mode, compile_default, step_math_ms
from train.run.compile.cuda_graphs import keep_grads

CUDA, CPU = torch.device("cuda"), torch.device("cpu")
H200 = peak_flops("NVIDIA H200", "bf16")


def test_compile_is_on_for_cuda_and_off_elsewhere():
    assert compile_default(CPU, "none")[0] is False
    assert compile_default(CUDA, "none")[0] is True
    on, why = compile_default(CUDA, "zero2")
    assert on is False and "SHARDING=zero2" in why


def model_of(family: str):
    """The kit's MODEL_SIZE=small of a family, its weights on the meta device (no memory)."""
    config = build_config("small", None, 8192, 0, family)
    auto = AutoModelForSeq2SeqLM if FAMILIES[family].layout.encoder_decoder else AutoModelForCausalLM
    with torch.device("meta"):
        return auto.from_config(config)


@pytest.mark.parametrize("family, mode, batch, length, graphs", [
    ("gpt2", "sft", 16, 1024, True),  # gpu-report's sft-grouped: about 11 ms
    ("gpt2", "dpo", 16, 1024, True),  # its dpo (16 pairs)
    ("t5", "sft", 20, 512, True),  # its t5-sft, the 0.7 % MFU path
    ("gpt2", "pretrain", 32, 1024, False),  # the optimized preset's 32 x 1024: about 22 ms, compute-bound
])  # fmt: skip
def test_graphs_where_the_gpu_tables_paths_are_launch_bound(family, mode, batch, length, graphs):
    cfg = resolve(None, {"mode": mode, "batch_size": batch})
    ms = step_math_ms(cfg, model_of(family), FAMILIES[family], length, H200)
    chosen, why = choose_mode(True, CUDA, 1, "none", False, ms)
    assert (chosen == "reduce-overhead") is graphs and (ms < LAUNCH_BOUND_MS) is graphs, (ms, why)
    assert f"{ms:.1f} ms" in why


def test_no_graphs_off_one_gpu_with_packed_rows_or_without_a_peak():
    assert choose_mode(True, CUDA, 1, "none", False, 5.0)[0] == "reduce-overhead"
    for args in ((CPU, 1, "none", False, 5.0), (CUDA, 2, "none", False, 5.0), (CUDA, 1, "zero2", False, 5.0),
                 (CUDA, 1, "none", True, 5.0), (CUDA, 1, "none", False, None)):
        assert choose_mode(True, *args)[0] == "default", args
    assert step_math_ms(resolve(None, {}), None, None, 64, None) is None  # a CPU or an unknown GPU: no peak


def decisions(run) -> dict:
    return {d["setting"]: d for d in json.loads((run / "config.json").read_text())["decisions"]}


def test_a_cpu_run_leaves_compile_off_and_compile_1_wins(tiny_flags, tmp_path, monkeypatch):
    argv = [*tiny_flags, "--batch_size", "2", "--max_steps", "1", "--val_fraction", "0"]
    assert run_cli("pretrain", *argv, "--run_name", "auto") == 0
    run = tmp_path / "runs" / "auto"
    made = decisions(run)
    assert made["compile"]["value"] is False and made["compile"]["reason"].startswith("cpu:"), made["compile"]
    assert "compile_mode" not in made
    assert json.loads((run / "summary.json").read_text())["compile"]["enabled"] is False
    monkeypatch.setattr(wrapper, "BACKEND", "eager")
    assert run_cli("pretrain", *argv, "--compile", "1", "--run_name", "asked") == 0
    run = tmp_path / "runs" / "asked"
    made = decisions(run)
    assert "compile" not in made and made["compile_mode"]["value"] == "default", made.get("compile_mode")
    assert json.loads((run / "summary.json").read_text())["compile"]["mode"] == "default"


def test_kept_gradients_train_as_set_to_none_does():
    """COMPILE_MODE=reduce-overhead's gradients (cuda_graphs.keep_grads): made once and zeroed in place,
    so backward adds into them and never keeps a replay's own buffer; the steps are the same as with
    .grad set to None (train_step with accumulation 2), and each .grad keeps its storage."""
    x = torch.randint(1, 500, (2, 16))
    params = []
    for kept in (False, True):
        model = tiny_model()
        opt, _ = build_optimizer(OptimConfig(learning_rate=1e-3), model, CPU)
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        if kept:
            keep_grads(model, opt)
            storage = [p.grad.data_ptr() for p in model.parameters()]
        for _ in range(3):
            train_step(
                model, opt, scaler, iter([{"input_ids": x}] * 2), 2, 1.0, CPU, "fp32", layout=CAUSAL_LM
            )
        if kept:
            assert [p.grad.data_ptr() for p in model.parameters()] == storage
            assert all(not p.grad.any() for p in model.parameters())  # zeroed after the step, in place
        params.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*params, strict=True):
        torch.testing.assert_close(b, a)
