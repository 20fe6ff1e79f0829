"""python -m train.tools.step_profile: one optimizer step of a real run traced, the loop untouched."""

from __future__ import annotations

import json

from conftest import read_jsonl
from train.tools.step_profile import busy_ns, category, main


def test_one_step_of_a_real_run_traced(tiny_flags, tmp_path, capsys):
    out = tmp_path / "p.json"
    flags = [*tiny_flags, "--batch_size", "4", "--max_steps", "3", "--run_name", "r"]
    assert main(["--json", str(out), "pretrain", *flags]) == 0
    r = json.loads(out.read_text())
    assert r["command"] == "pretrain" and r["step"] == 1 and r["device"] == "cpu"
    # a CPU has no kernels: GPU busy is n/a, the ops ranked by self CPU time (the matmuls among them)
    assert r["device_busy_frac"] is None and r["kernel_categories"] is None
    assert r["ranked_by"].startswith("self CPU time") and r["compiled_during_step"] is False
    names = [op["name"] for op in r["top_ops"]]
    assert 1 <= len(names) <= 8 and any(n in ("aten::mm", "aten::addmm") for n in names)
    assert all(op["cpu_ms"] > 0 and op["calls"] >= 1 for op in r["top_ops"])
    # the run itself went on as usual: all its steps, its summary
    run = tmp_path / "runs" / "r"
    assert json.loads((run / "summary.json").read_text())["steps"] == 3
    assert [row["step"] for row in read_jsonl(run / "metrics.jsonl") if "loss" in row][:3] == [1, 2, 3]
    shown = capsys.readouterr().out
    assert f"step_profile: step 1 took {r['step_ms']:.1f} ms; device busy n/a" in shown


def test_a_run_too_short_and_bad_input(tiny_flags, tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["--json", str(out), "--step", "5", "pretrain", *tiny_flags, "--max_steps", "2"]) == 0
    assert "before step 5 was over" in json.loads(out.read_text())["error"]
    capsys.readouterr()
    assert main(["--json", str(out), "pretrain", *tiny_flags, "--auto_batch", "1"]) == 2
    assert main(["--json", str(out), "--step", "0", "pretrain"]) == 2
    assert main(["--json", str(out), "bench"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and all(line.startswith("error: step_profile") for line in err)


def test_busy_time_is_the_union_inside_the_step():
    # two streams overlapping, one kernel half outside the window: 10..40 and 50..60 inside
    assert busy_ns([(0, 30), (20, 40), (50, 70), (80, 90)], 10, 60) == 40
    assert busy_ns([], 0, 10) == 0
    assert category("sm90_xmma_gemm_bf16bf16_bf16f32") == "matmul"
    assert category("pytorch_flash::flash_fwd_kernel") == "attention"
    assert category("triton_per_fused_add_native_layer_norm_0") == "norm / softmax / loss"
    assert category("triton_poi_fused_gelu_1") == "fused (Triton)"
    assert category("multi_tensor_apply_kernel<FusedAdamW>") == "optimizer"


def test_a_gpu_step_summarized_from_its_timeline():
    """The record a GPU step gives (kineto's kernel events as (name, start ns, end ns))."""
    from train.tools.step_profile import summarize

    work = [("sm90_xmma_gemm_bf16", 1_000_000, 5_000_000), ("flash_fwd_kernel", 4_000_000, 6_000_000),
            ("multi_tensor_apply_kernel<AdamW>", 8_000_000, 9_000_000), ("Memcpy HtoD", 0, 2_000_000)]
    ops = [{"name": "aten::mm", "device_ms": 4.0, "cpu_ms": 0.3, "calls": 12},
           {"name": "aten::_fused_adamw_", "device_ms": 1.0, "cpu_ms": 0.1, "calls": 1},
           {"name": "aten::view", "device_ms": 0.0, "cpu_ms": 0.5, "calls": 40}]
    r = summarize((1_000_000, 11_000_000), work, ops, 0.5, False, 1, "cuda")
    assert r["step_ms"] == 10.0  # the window, not the host's wall clock
    # busy: 1..6 (the gemm, the attention on another stream, the copy clipped to 1..2 under them) + 8..9
    assert r["device_busy_ms"] == 6.0 and r["device_busy_frac"] == 0.6
    assert [c["name"] for c in r["kernel_categories"]] == ["matmul", "attention", "copy / set", "optimizer"]
    assert r["kernel_categories"][0]["share"] == 4 / 9
    # zero device time left out
    assert [op["name"] for op in r["top_ops"]] == ["aten::mm", "aten::_fused_adamw_"]
    assert r["ranked_by"] == "self device time"


class _Event:
    """A kineto event as torch 2.11 gives it (seen on an H200): no activity_type."""

    def __init__(self, device: str, annotation: bool = False):
        import torch

        self._device = torch.autograd.DeviceType.CUDA if device == "cuda" else torch.autograd.DeviceType.CPU
        self._annotation = annotation

    def device_type(self):
        return self._device

    def is_user_annotation(self) -> bool:
        return self._annotation


def test_device_work_is_found_on_torch_without_activity_type():
    """torch 2.11 (the GPU machines' torch) has no KinetoEvent.activity_type: every profiled
    part of the 2026-11-27 gpu-report failed on it. There, device work is an event on the
    device that is not an annotation; here, where torch has activity_type, it is asked."""
    import torch

    from train.tools.step_profile import _device_work

    assert _device_work(_Event("cuda")) and not _device_work(_Event("cpu"))
    assert not _device_work(_Event("cuda", annotation=True))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ones(8) @ torch.ones(8)
    events = prof.profiler.kineto_results.events()
    assert events and not any(_device_work(e) for e in events)  # this torch's own path: CPU ops only
