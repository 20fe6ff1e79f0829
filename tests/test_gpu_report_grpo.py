"""make gpu-report's GRPO pair: the kit's GRPO part (grpo) against TRL's GRPOTrainer on its plan (grpo-trl):
the rows, targets and bench/gpu_table.json from a session's files; bench/peers.py's export of a GRPO plan;
and the part itself run by scripts/gpu_report.sh on the CPU (GPU_REPORT_DRY=1), profiled, into a table of
its own folder."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import ROOT, TINY_CONFIG, launch, run_cli
from train.tools import gpu_grpo
from train.tools.gpu_report import main

GRPO_SECTION = "GPT-2 reward training (GRPO, built-in task) against TRL GRPOTrainer"


def _kit_summary(**kw) -> dict:
    """summary.json of a GRPO run as report.summary writes it (the fields the GRPO rows read): 5 prompts/s of
    21 prompt tokens each, 8 rows of prompt + completion a prompt (tokens_per_sec: what the steps trained
    on; 100 tokens the steady completions' mean length)."""
    return {"mode": "grpo", "precision": "bf16", "batch_size": 4, "gradient_accumulation_steps": 1,
            "num_generations": 8, "max_completion_length": 128, "steps": 30, "steady_state_steps": 27,
            "step_time_ms": 800.0, "generation_frac": 0.75, "samples_per_sec": 5.0, "tokens_per_sec": 4840.0,
            "flops_per_token": 1e9, "peak_tflops": 989.0, "peak_vram_mb": 20000.0, "vram_total_mb": 143771.0,
            "estimate_peak_mb": 19000.0, "final_completions/mean_length": 77.0,
            "compile": {"enabled": True, "mode": "reduce-overhead", "graphs": 2}, "compile_error": None,
            **kw}  # fmt: skip


def _trl_result(step_ms: float) -> dict:
    """grpo-trl.json as bench/grpo_trl_side.py --kit writes it through bench/peer_side.py."""
    return {"trainer": "TRL GRPOTrainer", "versions": {"trl": "1.16.0"}, "device": "NVIDIA H200",
            "settings": {"batch_size": 4, "num_generations": 8, "rows": 32, "max_completion_length": 128,
                         "bf16": True, "gradient_checkpointing": False, "use_vllm": False,
                         "attn_implementation": "sdpa"},
            "steps": 30, "steady_state_steps": 27, "step_time_ms": step_ms, "samples_per_sec": 4000 / step_ms,
            "tokens_per_sec": 4000 / step_ms * 8 * 96, "generation_frac": 0.8, "completion_mean_length": 96.0,
            "peak_vram_mb": 30000.0, "vram_total_mb": 143771.0}  # fmt: skip


def _profile(busy: float) -> dict:
    return {"command": "grpo", "step": 2, "device": "cuda", "step_ms": 900.0, "device_busy_ms": 900 * busy,
            "device_busy_frac": busy, "top_ops": [], "compiled_during_step": False,
            "kernel_categories": [{"name": "matmul", "device_ms": 100.0, "share": 0.6}]}  # fmt: skip


def _session(out, trl_step_ms: float) -> None:
    (out / "grpo").mkdir(parents=True)
    (out / "grpo" / "summary.json").write_text(json.dumps(_kit_summary()))
    # the first 3 steps (not steady) sampled shorter completions: left out of the mean length
    rows = [
        {"step": i, "loss": 0.1, "completions/mean_length": 50.0 if i <= 3 else 100.0} for i in range(1, 31)
    ]
    (out / "grpo" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "grpo.profile.json").write_text(json.dumps(_profile(0.35)))
    (out / "grpo-trl.json").write_text(json.dumps(_trl_result(trl_step_ms)))
    (out / "grpo-trl.profile.json").write_text(json.dumps(_profile(0.30)))
    (out / "parts.tsv").write_text("grpo\t55\tok\ngrpo-trl\t70\tok\n")


def _report(out, tmp_path) -> tuple[str, dict]:
    results, table = tmp_path / f"{out.name}.md", tmp_path / f"{out.name}.json"
    results.write_text("# R\n")
    assert main(["--out", str(out), "--results", str(results), "--table", str(table), "--device", "H200",
                 "--date", "x"]) == 0  # fmt: skip
    return results.read_text(), json.loads(table.read_text())


def test_grpo_rows_targets_and_the_json_table(tmp_path):
    _session(tmp_path / "met", trl_step_ms=1200.0)
    text, table = _report(tmp_path / "met", tmp_path)
    section = text[text.index(GRPO_SECTION) :]
    # completion tokens/s: 5 prompts/s x 8 x 100 (the steady mean length); sampling: that / 0.75; MFU: 5 x 8 x
    # (21 + 100) tokens x 1e9 FLOPs over 989 TFLOP/s (0.49 %), over the training part's 25 % of the step
    assert (
        "| the kit (grpo) | bf16, 4 prompts x 8 = 32 rows x 1, completions <= 128, compile reduce-overhead "
        "| 800 | 75% | 4,000 | "
        "5,333 | 100.0 | 0.5% | 2.0% | 20,000 MB (14%) | 35% of 900 ms | 55 s |"
    ) in section
    assert (
        "| TRL GRPOTrainer (grpo-trl) | bf16, 4 prompts x 8 = 32 rows, completions <= 128, checkpointing 0, "
        "vLLM 0, sdpa | 1,200 | 80% | 2,560 | 3,200 | 96.0 | 0.3% | 1.6% | 30,000 MB (21%) | 30% of 900 ms "
        "| 70 s |"
    ) in section
    assert (
        "| GPT-2 reward training (GRPO, built-in task): TRL GRPOTrainer s/step / the kit's >= 1.3x | 1.50x "
        "(1,200 / 800 ms a step) | met |  |"
    ) in section
    assert (
        "GRPO, built-in task): peak memory >= 60% of the device or GPU busy >= 90% | memory 14%, GPU busy "
        "35% | missed | GPU busy 35% of the step; kernel time: matmul 60% |"
    ) in section

    parts = {p["name"]: p for p in table["parts"]}
    kit, peer = parts["grpo"], parts["grpo-trl"]
    assert (kit["kind"], kit["tokens_counted"], kit["step_time_ms"], kit["generation_frac"]) == (
        "kit",
        "completion tokens",
        800.0,
        0.75,
    )
    assert kit["tokens_per_sec"] == pytest.approx(4000) and kit["completion_mean_length"] == pytest.approx(
        100
    )
    assert kit["mfu"] == pytest.approx(5 * 8 * 121 * 1e9 / 989e12)
    assert kit["mfu_training"] == pytest.approx(kit["mfu"] / 0.25) and kit["gpu_busy"] == 0.35
    assert kit["estimate_mb"] == 19000.0 and kit["memory_share"] == pytest.approx(20000 / 143771)
    assert [g["met"] for g in kit["targets"]] == [False] and kit["met"] is False  # the fill target
    assert (peer["kind"], peer["trainer"], peer["against"], peer["targets"], peer["met"]) == (
        "peer",
        "TRL GRPOTrainer",
        "grpo",
        [],
        None,
    )
    assert peer["tokens_per_sec"] == pytest.approx(2560) and peer["settings"]["rows"] == 32
    assert peer["mfu_training"] == pytest.approx((4000 / 1200) * 8 * 117 * 1e9 / 989e12 / 0.2)
    ratio = {r["name"]: r for r in table["ratios"]}["grpo / grpo-trl"]
    assert ratio["ratio"] == pytest.approx(1.5) and ratio["met"] is True and ratio["target"] == 1.3
    assert (
        ratio["measure"] == "seconds per optimizer step, peer / kit" and ratio["trainer"] == "TRL GRPOTrainer"
    )

    _session(tmp_path / "missed", trl_step_ms=900.0)
    text, table = _report(tmp_path / "missed", tmp_path)
    assert "| 1.12x (900 / 800 ms a step) | missed by 0.18x |" in text
    assert {r["name"]: r for r in table["ratios"]}["grpo / grpo-trl"]["met"] is False


def test_the_kit_row_states_the_runs_compile_as_summary_json_has_it():
    base = "bf16, 4 prompts x 8 = 32 rows x 1, completions <= 128"
    assert gpu_grpo._kit_settings(_kit_summary()) == base + ", compile reduce-overhead"
    eager = {"enabled": False, "mode": None}
    assert gpu_grpo._kit_settings(_kit_summary(compile=eager)) == base + ", eager"
    failed = _kit_summary(compile=eager, compile_error="no triton")
    assert gpu_grpo._kit_settings(failed) == base + ", eager (compile failed: no triton)"
    assert gpu_grpo._kit_settings(_kit_summary(compile=None)) == base  # an older summary: nothing claimed


def test_no_grpo_section_without_its_parts_and_a_peer_that_failed(tmp_path):
    (tmp_path / "none").mkdir()
    text, table = _report(tmp_path / "none", tmp_path)
    assert GRPO_SECTION not in text and "grpo" not in {p["name"] for p in table["parts"]}
    assert {r["name"]: r for r in table["ratios"]}["grpo / grpo-trl"]["met"] is None
    out = tmp_path / "failed"
    _session(out, 1200.0)
    (out / "grpo-trl.json").unlink()
    (out / "parts.tsv").write_text("grpo\t55\tok\ngrpo-trl\t120\tstopped after 120 s\n")
    text, table = _report(out, tmp_path)
    assert (
        "| TRL GRPOTrainer (grpo-trl) | | | | | | | | | | | 120 s, stopped after 120 s (see grpo-trl.log) |"
    ) in text
    assert "s/step / the kit's >= 1.3x | n/a | not measured |" in text
    peer = {p["name"]: p for p in table["parts"]}["grpo-trl"]
    assert peer["tokens_per_sec"] is None and peer["step_time_ms"] is None and peer["versions"] is None


@pytest.fixture(scope="module")
def chat_base(tmp_path_factory, corpus, cache_dir):
    """A tiny pretrained GPT-2 with room for the built-in task's prompts and completions (256 positions)."""
    root = tmp_path_factory.mktemp("grpo-base")
    config = root / "config.json"
    config.write_text(json.dumps({**TINY_CONFIG, "n_positions": 256}))
    argv = ["--model_config", str(config), "--data_path", str(corpus), "--vocab_size", "512", "--cache_dir",
            str(cache_dir), "--output_dir", str(root), "--max_length", "64", "--batch_size", "4",
            "--max_steps", "1", "--run_name", "base"]  # fmt: skip
    assert run_cli("pretrain", *argv) == 0
    return root / "base" / "final"


def test_peer_export_of_a_grpo_plan(chat_base, cache_dir, tmp_path):
    """bench/peers.py hands TRL the GRPO plan's prompts as token ids (the text they decode to, the answer
    column), the stop ids, the loss and sampling knobs and the rewards as the kit resolved them."""
    import importlib.util

    from train.config.flags import parse_training_args
    from train.run.plan.build import build

    spec = importlib.util.spec_from_file_location(
        "peers", ROOT / "bench" / "peers.py"
    )  # bench/ is no package
    peers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peers)
    flags = [
        "--preset",
        "grpo",
        "--model_path",
        str(chat_base),
        "--max_completion_length",
        "8",
        "--max_length",
        "128",
        "--cache_dir",
        str(cache_dir),
        "--output_dir",
        str(tmp_path / "runs"),
        "--num_workers",
        "0",
    ]
    run = tmp_path / "kit-run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"batch_size": 6, "gradient_accumulation_steps": 1,
                                                  "precision": "bf16"}))  # fmt: skip
    s = peers.export("grpo", flags, tmp_path / "w", run, 30, print)
    plan = build(parse_training_args("grpo", [*flags, "--dry_run", "1"]), lambda line: None)
    rows = [json.loads(line) for line in (tmp_path / "w" / "examples.jsonl").read_text().splitlines()]
    assert len(rows) == s["n_examples"] == len(plan.objective.prompt_ids) > 100
    assert [r["prompt_ids"] for r in rows] == plan.objective.prompt_ids
    assert rows[0]["prompt"] == plan.tokenizer.decode(rows[0]["prompt_ids"]) and "answer" in rows[0]
    assert rows[0]["answer"] == plan.objective.for_rewards([0])[1]["answer"][0]
    g = s["grpo"]
    assert (g["num_generations"], g["max_completion_length"], g["loss_type"], g["beta"]) == (
        8,
        8,
        "dapo",
        0.0,
    )
    assert g["eos_ids"] == plan.objective.sampler.eos_ids and g["builtin_data"] is True
    assert (g["reward_funcs"], g["reward_weights"], g["top_k"]) == (["accuracy", "format"], [1.0, 1.0], 0)
    assert (s["batch_size"], s["precision"], s["command"]) == (6, "bf16", "grpo")  # the kit run's
    assert peers.main(["grpo-trl", "--work", str(tmp_path / "x"), "--", "dpo"]) == 2
    assert not (tmp_path / "x").exists()


def test_the_dry_report_runs_the_grpo_part_on_the_cpu(chat_base, tmp_path):
    """GPU_REPORT_DRY=1: the grpo part's own command (./train_grpo.sh under step_profile) on the CPU at toy
    sizes, from the session's SFT model, its step 2 profiled, the table in GPU_REPORT_DIR, never bench/'s."""
    out = tmp_path / "out"
    shutil.copytree(chat_base, out / "sft-grouped" / "final")  # the session's chat model (grpo's base)
    before = {name: (ROOT / "bench" / name).read_bytes() for name in ("RESULTS.md", "gpu_table.json")
              if (ROOT / "bench" / name).is_file()}  # fmt: skip
    env = {"GPU_REPORT_DRY": "1", "GPU_REPORT_PARTS": "grpo", "GPU_REPORT_DIR": str(out),
           "CACHE_DIR": str(tmp_path / "cache")}  # fmt: skip
    proc = launch("scripts/gpu_report.sh", env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert (
        "GPU_REPORT_DRY=1: on the CPU at toy sizes" in proc.stdout and "gpu-report: grpo: ok" in proc.stdout
    )
    assert [line.split("\t")[0] for line in (out / "parts.tsv").read_text().splitlines()] == ["grpo"]
    summary = json.loads((out / "grpo" / "summary.json").read_text())
    assert (summary["mode"], summary["num_generations"], summary["max_completion_length"]) == ("grpo", 8, 8)
    assert summary["model_path"] == str(out / "sft-grouped" / "final") and summary["steps"] == 4
    profile = json.loads((out / "grpo.profile.json").read_text())
    assert (profile["command"], profile["step"], profile["device"]) == ("grpo", 2, "cpu") and profile[
        "step_ms"
    ] > 0
    text = (out / "RESULTS.md").read_text()
    # COMPILE left empty, as a user runs it: off on the CPU, and the row says so
    assert "| the kit (grpo) | fp32, 4 prompts x 8 = 32 rows x 1, completions <= 8, eager |" in text
    kit = {p["name"]: p for p in json.loads((out / "gpu_table.json").read_text())["parts"]}["grpo"]
    assert kit["status"] == "ok" and kit["tokens_per_sec"] > 0 and 0 < kit["generation_frac"] <= 1
    assert before == {name: (ROOT / "bench" / name).read_bytes() for name in before}
    bad = launch("scripts/gpu_report.sh", {"GPU_REPORT_DRY": "2"})
    assert bad.returncode == 2 and "GPU_REPORT_DRY: expected 0 or 1, got '2'" in bad.stderr
