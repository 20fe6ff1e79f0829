"""make gpu-report: one line and exit 0 without a GPU; the GPU table section written and replaced,
the peers' rows and the kit / peer ratios, bench/gpu_table.json; the peers' export of the kit's plan."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import ROOT, launch
from train.tools.gpu_report import HEADING, main, replace_section


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the script runs the whole report")
def test_without_cuda_one_line_and_exit_0():
    before = (ROOT / "bench" / "RESULTS.md").read_text()
    proc = launch("scripts/gpu_report.sh", {})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-report: no CUDA GPU here; on one it runs bench")
    assert "find-batch" in lines[0] and "PACKING=0 vs 1" in lines[0] and proc.stderr == ""
    assert "TRL's SFT and DPO trainers" in lines[0] and lines[0].endswith("bench/gpu_table.json")
    assert (ROOT / "bench" / "RESULTS.md").read_text() == before


def _bench(precision, compile_, batch, accum, ms, tps, tflops, mfu):
    return {
        "model_size": "small",
        "precision": precision,
        "compile": compile_,
        "batch_size": batch,
        "gradient_accumulation_steps": accum,
        "max_length": 1024,
        "startup": {"compile_s": 41.0} if compile_ else {},
        "kit": {"ms_per_step": ms, "tokens_per_sec": tps, "achieved_tflops": tflops, "mfu": mfu},
    }


def _session(out, sft_loss=1.2345, packing_key=True):
    out.mkdir()
    (out / "bench-baseline.json").write_text(
        json.dumps(_bench("fp32", False, 8, 1, 310.0, 26400.0, 20.5, 0.021))
    )
    (out / "bench-optimized.json").write_text(
        json.dumps(_bench("bf16", True, 32, 4, 600.0, 218000.0, 170.2, 0.172))
    )
    (out / ".auto_batch.json").write_text(json.dumps({
        "batch_size": 64, "gradient_accumulation_steps": 2, "effective_batch": 128, "largest_safe": 96,
        "limit_mb": 64000.0, "capacity_mb": 80000.0, "samples_per_sec": 230.5, "peak_mb": 51000.0,
        "key": {"precision": "bf16"}}))
    (out / "doctor-before-x").mkdir()
    (out / "doctor-before-x" / "doctor.json").write_text(json.dumps({
        "before": {"precision": "bf16"}, "verdict": {"kind": "input-bound", "why": "data wait 31 %"},
        "try": "NUM_WORKERS=8"}))
    for p, eff in ((0, 0.41), (1, 0.97)):
        (out / f"sft-packing{p}").mkdir()
        summary = {
            "batch_size": 16,
            "precision": "bf16",
            "padding_efficiency": eff,
            "samples_per_sec": 100.0 + p,
            "tokens_per_sec": 9000.0 * (1 + p),
            "step_time_ms": 160.0,
            "final_loss": sft_loss,
        }
        if packing_key:
            summary["packing"] = bool(p)
        (out / f"sft-packing{p}" / "summary.json").write_text(json.dumps(summary))
    (out / "parts.tsv").write_text("bench-baseline\t35\tok\nbench-optimized\t95\tok\nfind-batch\t60\tok\n"
                                   "doctor\t90\tstopped after 90 "
                                   "s\nsft-packing0\t40\tok\nsft-packing1\t41\tok\n")


def test_table_written_then_replaced_in_a_copy_of_results(tmp_path, capsys):
    results = tmp_path / "RESULTS.md"
    shutil.copy(ROOT / "bench" / "RESULTS.md", results)
    original = results.read_text()
    if HEADING in original:  # a GPU report is already there: start from the file without it
        original = replace_section(original, "").rstrip("\n") + "\n"
        results.write_text(original)
    _session(tmp_path / "a")
    args = [
        "--results",
        str(results),
        "--device",
        "NVIDIA H100 80GB HBM3 (torch 2.13.0)",
        "--date",
        "2026-11-23",
    ]
    assert main(["--out", str(tmp_path / "a"), *args]) == 0
    text = results.read_text()
    assert text.startswith(original.rstrip("\n")) and text.count(HEADING) == 1
    table = text[text.index(HEADING):]
    assert "**NVIDIA H100 80GB HBM3 (torch 2.13.0)**, 2026-11-23. GPT-2 small, T=1024" in table
    assert ("| bench, baseline preset | fp32, compile 0, batch 8 x 1, T=1024 | 310.0 | 26,400 | 20.5 | 2.1% "
            "| 35 s |") in table
    assert ("| bench, optimized preset | bf16, compile 1, batch 32 x 4, T=1024 | 600.0 | 218,000 | 170.2 | "
            "17.2% | 95 s |") in table
    assert "Optimized / baseline: **x8.26** tokens/s" in table and "about 41 s" in table
    assert ("| find-batch (bf16) | BATCH_SIZE=64 GRADIENT_ACCUM=2 (largest safe 96, 230.5 samples/s, peak "
            "51,000 of 64,000 MB) | 60 s |") in table
    assert ("| doctor (bf16) | input-bound: data wait 31 %; try: NUM_WORKERS=8 | 90 s, stopped after 90 s "
            "(see doctor.log) |") in table
    assert "| 0 | 16 | bf16 | 41.0% | 100.00 | 9,000 | 160 | 1.2345 | 40 s |" in table
    assert "| 1 | 16 | bf16 | 97.0% | 101.00 | 18,000 | 160 | 1.2345 | 41 s |" in table
    assert "not a setting of this checkout" not in table
    assert capsys.readouterr().out.endswith(f"gpu-report: wrote the GPU table of {results} and "
                                            f"{tmp_path / 'gpu_table.json'}\n")

    _session(tmp_path / "b", sft_loss=9.8765, packing_key=False)  # a second session replaces the first
    assert main(["--out", str(tmp_path / "b"), *args]) == 0
    again = results.read_text()
    assert again.count(HEADING) == 1 and again.startswith(original.rstrip("\n"))
    assert "9.8765" in again and "1.2345" not in again and "not a setting of this checkout yet" in again


def test_missing_parts_and_a_section_between_others(tmp_path):
    (tmp_path / "empty").mkdir()
    results = tmp_path / "R.md"
    results.write_text("# R\n\n## A\n\na\n\n## GPU table\n\nold figures\n\n## Z\n\nz\n")
    assert (
        main(["--out", str(tmp_path / "empty"), "--results", str(results), "--device", "d", "--date", "x"])
        == 0
    )
    text = results.read_text()
    assert text.startswith("# R\n\n## A\n\na\n\n## GPU table\n") and text.endswith("\n\n## Z\n\nz\n")
    assert "old figures" not in text and "| bench, baseline preset | | | | | | not run |" in text
    assert "| find-batch | no result | not run |" in text and "| doctor | no result | not run |" in text
    # replacing is idempotent and leaves every other line as it was
    section = text[text.index(HEADING) : text.index("## Z")].rstrip("\n") + "\n"
    assert replace_section(text, section) == text
    assert replace_section("# R\n", "## GPU table\n\nnew\n") == "# R\n\n## GPU table\n\nnew\n"
    assert main(["--out", str(tmp_path / "nowhere"), "--results", str(results)]) == 2


def _summary(**kw):
    """A summary.json as report.summary writes it (the fields the GPU table reads)."""
    base = {
        "precision": "bf16",
        "batch_size": 32,
        "gradient_accumulation_steps": 4,
        "max_length": 1024,
        "tokens_per_sec": 500000.0,
        "mfu": 0.31,
        "peak_vram_mb": 28000.0,
        "estimate_peak_mb": 27000.0,
        "host_syncs_per_step": 1.0,
        "compute_frac": 0.97,
        "padding_efficiency": 1.0,
        "compile": {"enabled": True, "graph_breaks": 0, "recompiles": 0, "graphs": 1},
        "compile_error": None,
    }
    return {**base, **kw}


def _profile(busy, cats):
    """NAME.profile.json as train/tools/step_profile.py writes it on a GPU."""
    return {"command": "sft", "step": 1, "device": "cuda", "step_ms": 240.0, "device_busy_ms": 240.0 * busy,
            "device_busy_frac": busy, "ranked_by": "self device time", "compiled_during_step": False,
            "top_ops": [{"name": "aten::mm", "device_ms": 80.0, "cpu_ms": 3.0, "calls": 96}],
            "kernel_categories": [{"name": n, "device_ms": 100 * s, "share": s} for n, s in cats]}


def _paths_session(out):
    out.mkdir()
    (out / "doctor-before-x").mkdir()
    (out / "doctor-before-x" / "doctor.json").write_text(json.dumps({
        "before": {"precision": "bf16"}, "verdict": {"kind": "compute-bound", "why": "w"}, "try": ""}))
    (out / "doctor-before-x" / "summary.json").write_text(json.dumps(_summary()))
    (out / "pretrain-preset.log").write_text(
        "resolved config:\nfind-batch measured BATCH_SIZE=64 GRADIENT_ACCUM=2 at 230.5 samples/s on NVIDIA "
        "H100, "
        "1.14x this run's 32 x 4 (201.6 samples/s); AUTO_BATCH=1 takes it (effective batch kept), or set "
        "both\n")
    (out / "pretrain-preset.profile.json").write_text(json.dumps(_profile(0.93, [("matmul", 0.7)])))
    runs = {
        "pretrain-auto": _summary(
            batch_size=64, gradient_accumulation_steps=2, mfu=0.47, tokens_per_sec=760000.0
        ),
        # no host_syncs_per_step (an older checkout), eager: n/a and "off"
        "sft-grouped": {
            k: v
            for k, v in _summary(
                batch_size=16,
                gradient_accumulation_steps=1,
                tokens_per_sec=300000.0,
                padding_efficiency=0.9,
                mfu=0.19,
                compile={"enabled": False, "graph_breaks": None, "recompiles": None, "graphs": None},
            ).items()
            if k != "host_syncs_per_step"
        },
        "sft-packing1": _summary(
            batch_size=16,
            gradient_accumulation_steps=1,
            tokens_per_sec=460000.0,
            mfu=0.29,
            packing=True,
            compile={"enabled": True, "graph_breaks": 0, "recompiles": 2, "graphs": 3},
        ),
        "t5-pretrain": _summary(
            max_length=512,
            tokens_per_sec=247426.0,
            mfu=0.039,
            peak_vram_mb=9053.0,
            estimate_peak_mb=6099.0,
            compile={
                "enabled": True,
                "graph_breaks": 0,
                "recompiles": 0,
                "graphs": 1,
                "cuda_graphs": 2,
                "cudagraph_skips": 0,
            },
        ),
    }
    for name, summary in runs.items():
        (out / name).mkdir()
        (out / name / "summary.json").write_text(json.dumps(summary))
    (out / "pretrain-auto.log").write_text(
        "AUTO_BATCH=1: BATCH_SIZE=64 GRADIENT_ACCUM=2 (was 32 x 4; kept)\n"
    )
    (out / "sft-grouped.profile.json").write_text(
        json.dumps(_profile(0.41, [("matmul", 0.5), ("attention", 0.2), ("optimizer", 0.1), ("other", 0.05)]))
    )
    (out / "t5-sft.profile.json").write_text(
        json.dumps({"command": "sft", "step": 1, "error": "the run ended"})
    )
    (out / "parts.tsv").write_text("find-batch\t90\tok\npretrain-preset\t61\tok\nsft-grouped\t36\tok\n"
                                   "sft-packing1\t55\tok\nt5-pretrain\t70\tok\nt5-sft\t60\tstopped after 60 "
                                   "s\npretrain-auto\t58\tok\nbench-baseline\t46\tok\n")
    (out / "bench-baseline.json").write_text(
        json.dumps(_bench("fp32", False, 8, 1, 150.2, 54543.0, 36.3, 0.542))
    )


def test_paths_rows_targets_and_profiles(tmp_path):
    _paths_session(tmp_path / "s")
    results = tmp_path / "R.md"
    results.write_text("# R\n")
    assert (
        main(["--out", str(tmp_path / "s"), "--results", str(results), "--device", "d", "--date", "x"]) == 0
    )
    t = results.read_text()
    # the optimized bench was not run: no empty row for it, the ratio from the preset's run
    assert "bench, optimized preset" not in t and "| bench, baseline preset | fp32, compile 0" in t
    assert "Optimized / baseline: **x9.17** tokens/s (optimized: the pretrain-preset run below)." in t
    assert (
        "| GPT-2 small pretraining, optimized preset | bf16, 32 x 4, T=1024 | 500,000 | 31.0% | 28,000 "
        "MB, estimated 27,000 (-4%) | 1.00 | 1 graphs, 0 recompiles, 0 breaks | 97% | 93% of 240 ms | 61 s |"
    ) in t
    assert "| GPT-2 small pretraining, AUTO_BATCH=1 | bf16, 64 x 2, T=1024 | 760,000 | 47.0% |" in t
    assert "| GPT-2 SFT, LENGTH_GROUPING=1 | bf16, 16 x 1, T=1024 | 300,000 | 19.0% | 28,000 MB, estimated " \
           "27,000 (-4%) | n/a | off | 97% | 41% of 240 ms | 36 s |" in t
    assert "| 3 graphs, 2 recompiles, 0 breaks |" in t
    # COMPILE_MODE=reduce-overhead
    assert "| 1 graphs, 0 recompiles, 0 breaks, 2 CUDA graphs (0 left uncaptured) |" in t
    assert "| T5 small SFT | | | | | | | | | 60 s, stopped after 60 s (see t5-sft.log) |" in t
    assert 'the run said: "find-batch measured BATCH_SIZE=64 GRADIENT_ACCUM=2 at 230.5 samples/s' in t
    assert 'the run said: "AUTO_BATCH=1: BATCH_SIZE=64 GRADIENT_ACCUM=2 (was 32 x 4; kept)"' in t
    # targets: met / missed by how much / not measured, and the profile beside a miss
    assert (
        "| GPT-2 small pretraining (preset) MFU >= 45% | 31.0% | missed by 14.0 points | GPU busy 93% of the "
        "step; kernel time: matmul 70% |" in t
    )
    assert "| GPT-2 small pretraining (AUTO_BATCH=1) MFU >= 45% | 47.0% | met | |" in t
    assert "| packed SFT tokens/s >= 90% of pretraining's (500,000) | 460,000 | met | |" in t
    assert ("| grouped SFT tokens/s >= 0.8 x padding efficiency (90.0%) x pretraining's = 360,000 | 300,000 "
            "| missed by 60,000 tokens/s (17% short) | GPU busy 41% of the step; kernel time: matmul 50%, "
            "attention 20%, optimizer 10% |") in t
    assert ("| T5 small pretraining (span corruption) MFU >= 25% | 3.9% | missed by 21.1 points | not "
            "profiled |") in t
    assert "| T5 small SFT MFU >= 15% | n/a | not measured | |" in t
    assert ("| T5 small pretraining (span corruption): memory estimate within 10% of the peak | estimate "
            "6,099 MB vs peak 9,053 MB (-33%) | missed by 23 points |") in t
    assert "| T5 small SFT: memory estimate within 10% of the peak | n/a | not measured | |" in t
    # the profile section: only the paths that were profiled
    assert (
        "| GPT-2 SFT, LENGTH_GROUPING=1 | 240.0 | 41% | matmul 50%, attention 20%, optimizer 10%, other 5% | "
        "aten::mm 80.0 ms |" in t
    )
    section = t[t.index("One step of each path"):]
    assert "T5 small SFT" not in section and "T5 small pretraining" not in section


def _peer(trainer, tps, busy=None, peak=None):
    """NAME.json as bench/peer_side.py writes it on a GPU."""
    return {
        "trainer": trainer,
        "versions": {"torch": "2.11.0", "transformers": "5.17.0", "trl": "1.16.0"},
        "device": "NVIDIA H200",
        "settings": {
            "packing": "bfd",
            "padding_free": True,
            "batch_size": 16,
            "max_length": 1024,
            "bf16": True,
            "gradient_checkpointing": False,
            "torch_compile": False,
            "attn_implementation": "sdpa",
        },
        "steps": 30,
        "steady_state_steps": 27,
        "tokens_per_sec": tps,
        "samples_per_sec": 10.0,
        "step_time_ms": 80.0,
        "padding_efficiency": 1.0,
        "peak_vram_mb": peak,
        "vram_total_mb": 143771.0,
        "final_loss": 2.0,
    }


def test_peers_ratios_and_the_json_table(tmp_path):
    out = tmp_path / "s"
    _paths_session(out)
    # the kit's DPO and T5 SFT rows, a device total for the memory share
    for name, summary in (
        ("dpo", _summary(tokens_per_sec=400000.0, mfu=0.2, peak_vram_mb=100000.0, vram_total_mb=143771.0)),
        (
            "t5-sft",
            _summary(
                max_length=512,
                tokens_per_sec=40000.0,
                mfu=0.02,
                vram_total_mb=143771.0,
                peak_vram_mb=9000.0,
                estimate_peak_mb=8500.0,
            ),
        ),
    ):
        (out / name).mkdir()
        (out / name / "summary.json").write_text(json.dumps(summary))
    (out / "trl-sft-packed.json").write_text(json.dumps(_peer("TRL SFTTrainer", 200000.0, peak=30000.0)))
    (out / "trl-sft-packed.profile.json").write_text(json.dumps(_profile(0.6, [("attention", 0.5)])))
    (out / "trl-dpo.json").write_text(json.dumps(_peer("TRL DPOTrainer", 350000.0, peak=60000.0)))
    with (out / "parts.tsv").open("a") as f:
        f.write("trl-sft-padfree\t44\tfailed (exit 1)\ntrl-sft-packed\t47\tok\nt5-sft\t20\tok\ndpo\t25\tok\n"
                "trl-dpo\t41\tok\nseq2seq-t5-sft\t0\tskipped (no trl here and no .whl/ wheels)\n")
    results, table = tmp_path / "R.md", tmp_path / "t.json"
    results.write_text("# R\n")
    assert main(["--out", str(out), "--results", str(results), "--table", str(table), "--device", "H200",
                 "--date", "x"]) == 0
    t = results.read_text()
    # the peers' rows, named by their trainer, beside the kit's figures; MFU by the kit's FLOPs per token
    assert ("| TRL SFTTrainer (trl-sft-packed): GPT-2 SFT, packed rows | sft-packing1 | bf16, packing bfd, "
            "batch 16, "
            "T=1024, checkpointing 0, compile 0, sdpa | 200,000 | 12.6% | 30,000 MB (21%) | 60% of 240 ms | "
            "460,000 | 2.30x | 47 s |") in t
    assert ("| TRL SFTTrainer (trl-sft-padfree): GPT-2 SFT, one conversation per example | sft-grouped | | | "
            "| | | | | 44 s, failed (exit 1) (see trl-sft-padfree.log) |") in t
    assert "Peer versions: torch 2.11.0, transformers 5.17.0, trl 1.16.0." in t
    # the ratios and the new targets
    assert ("| GPT-2 SFT, packed rows: the kit / TRL SFTTrainer real tokens/s >= 1.3x | 2.30x (460,000 / "
            "200,000) | met |") in t
    assert ("| GPT-2 DPO: the kit / TRL DPOTrainer real tokens/s >= 1.3x | 1.14x (400,000 / 350,000) | "
            "missed by 0.16x |") in t
    assert ("| T5 small SFT: the kit / transformers Seq2SeqTrainer real tokens/s >= 1.3x | n/a | not "
            "measured |") in t
    assert "| DPO real tokens/s >= 0.8 x packed SFT's (460,000) | 400,000 | met |" in t
    assert ("| GPT-2 preference training (DPO, REFERENCE=copy): peak memory >= 60% of the device or GPU busy "
            ">= 90% | memory 70%, GPU busy n/a | met |") in t
    assert ("| GPT-2 SFT, LENGTH_GROUPING=1: peak memory >= 60% of the device or GPU busy >= 90% | memory "
            "n/a, GPU busy 41% | missed |") in t

    j = json.loads(table.read_text())
    assert (j["device"], j["date"], j["out"]) == ("H200", "x", str(out))
    parts = {p["name"]: p for p in j["parts"]}
    assert list(parts)[:3] == ["find-batch", "pretrain-preset", "sft-grouped"]  # parts.tsv's order
    preset = parts["pretrain-preset"]
    assert (preset["kind"], preset["tokens_per_sec"], preset["mfu"], preset["gpu_busy"]) == (
        "kit",
        500000.0,
        0.31,
        0.93,
    )
    assert (preset["peak_memory_mb"], preset["estimate_mb"], preset["memory_share"]) == (
        28000.0,
        27000.0,
        None,
    )
    assert [(g["target"], g["goal"], g["met"]) for g in preset["targets"]] == [
        ("GPT-2 small pretraining (preset) MFU >= 45%", 0.45, False),
        ("GPT-2 small pretraining, optimized preset: peak memory >= 60% of the device or GPU busy >= 90%",
         {"memory_share": 0.6, "gpu_busy": 0.9}, True)]
    assert preset["met"] is False and parts["pretrain-auto"]["met"] is True
    assert parts["dpo"]["memory_share"] == pytest.approx(100000 / 143771) and parts["dpo"]["met"] is True
    t5 = parts["t5-sft"]
    assert [g["met"] for g in t5["targets"]] == [False, True, False]  # MFU, estimate within 10 % (-6 %), fill
    peer = parts["trl-sft-packed"]
    assert (peer["kind"], peer["trainer"], peer["against"], peer["gpu_busy"]) == ("peer", "TRL SFTTrainer",
                                                                                 "sft-packing1", 0.6)
    assert peer["mfu"] == pytest.approx(0.29 * 200000 / 460000) and peer["memory_share"] == pytest.approx(
        30000 / 143771
    )
    assert peer["targets"] == [] and peer["met"] is None and peer["settings"]["packing"] == "bfd"
    assert parts["seq2seq-t5-sft"] == {
        "name": "seq2seq-t5-sft",
        "status": "skipped (no trl here and no .whl/ wheels)",
        "seconds": 0,
        "kind": "peer",
        "trainer": "transformers Seq2SeqTrainer",
        "against": "t5-sft",
        "settings": None,
        "versions": None,
        "tokens_per_sec": None,
        "mfu": None,
        "gpu_busy": None,
        "peak_memory_mb": None,
        "memory_share": None,
        "estimate_mb": None,
        "padding_efficiency": None,
        "targets": [],
        "met": None,
    }
    assert parts["bench-baseline"]["tokens_per_sec"] == 54543.0 and parts["bench-baseline"]["targets"] == []
    ratios = {r["name"]: r for r in j["ratios"]}
    assert ratios["sft-packing1 / trl-sft-packed"] | {"ratio": None} == {
        "name": "sft-packing1 / trl-sft-packed", "kit": "sft-packing1", "peer": "trl-sft-packed",
        "trainer": "TRL SFTTrainer", "ratio": None, "target": 1.3, "met": True}
    assert ratios["sft-packing1 / trl-sft-packed"]["ratio"] == pytest.approx(2.3)
    assert ratios["dpo / trl-dpo"]["met"] is False and ratios["t5-sft / seq2seq-t5-sft"]["met"] is None
    assert ratios["sft-grouped / trl-sft-padfree"]["met"] is None


def _bench_module(name: str):
    """A bench/ script as a module (bench/ is no package: its scripts run as files)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_peer_export_is_the_kits_plan(base_model, cache_dir, tmp_path):
    """bench/peers.py hands a peer the kit's training conversations (held-out ones left out, PACKING=1's
    too), the resized model and tokenizer, and the kit run's batch and precision."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from train.config.flags import parse_training_args
    from train.run.plan.build import build

    peers = _bench_module("peers")
    flags = [
        "--model_path",
        str(base_model),
        "--max_length",
        "64",
        "--cache_dir",
        str(cache_dir),
        "--output_dir",
        str(tmp_path / "runs"),
        "--batch_size",
        "4",
        "--num_workers",
        "0",
    ]
    plain = peers.export("sft", flags, tmp_path / "plain", None, 30, print)
    run = tmp_path / "kit-run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"batch_size": 12, "gradient_accumulation_steps": 2,
                                                  "precision": "bf16"}))
    packed = peers.export("sft", [*flags, "--packing", "1"], tmp_path / "packed", run, 30, print)
    kit = build(parse_training_args("sft", [*flags, "--dry_run", "1"]), lambda line: None)
    rows = [json.loads(line) for line in (tmp_path / "plain" / "examples.jsonl").read_text().splitlines()]
    # the held-out tail left out
    assert len(rows) == len(kit.dataset) == plain["n_examples"] and 0 < len(rows) < 3000
    assert rows[0] == {
        "input_ids": list(kit.dataset[0]["input_ids"]),
        "labels": list(kit.dataset[0]["labels"]),
    }
    assert -100 in rows[0]["labels"] and len(rows[0]["labels"]) == len(rows[0]["input_ids"]) <= 64
    assert (tmp_path / "packed" / "examples.jsonl").read_text() == (
        tmp_path / "plain" / "examples.jsonl"
    ).read_text()
    assert (plain["batch_size"], plain["gradient_accumulation_steps"], plain["precision"]) == (4, 1, "fp32")
    assert (packed["batch_size"], packed["gradient_accumulation_steps"], packed["precision"]) == (
        12,
        2,
        "bf16",
    )
    assert (plain["max_length"], plain["steps"], plain["skip"], plain["encoder_decoder"]) == (
        64,
        30,
        3,
        False,
    )
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "plain" / "model")
    tok = AutoTokenizer.from_pretrained(tmp_path / "plain" / "model")
    base = AutoTokenizer.from_pretrained(base_model)
    # the template's chat tokens added
    assert model.get_input_embeddings().weight.shape[0] >= len(tok) > len(base)
    assert (
        max(max(r["input_ids"]) for r in rows) < len(tok) and tok.chat_template == kit.tokenizer.chat_template
    )
    # the wrong kit command for the peer, or a kit part that left no summary: one line, exit 2
    assert peers.main(["trl-dpo", "--work", str(tmp_path / "w"), "--", "sft", *flags]) == 2
    assert (
        peers.main(["trl-sft-packed", "--work", str(tmp_path / "w"), "--run", str(tmp_path), "--", "sft"])
        == 2
    )
    assert not (tmp_path / "w").exists()


def test_peer_token_counts_are_the_kits_units():
    """Real tokens as the kit's meter counts them: attention_mask, every position of a padding-free
    row, an encoder-decoder's labels that are not -100 added; samples are conversations or pairs."""
    side = _bench_module("peer_side")
    padfree = {"input_ids": torch.ones(1, 10, dtype=torch.long), "cu_seq_lens_q": torch.tensor([0, 3, 7, 10])}
    assert side.count_tokens(padfree, False) == (3, 10, 10)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    pairs = {
        "input_ids": torch.zeros(4, 4, dtype=torch.long),
        "attention_mask": mask,
        "completion_mask": mask,
    }
    assert side.count_tokens(pairs, False) == (2, 10, 16)
    t5 = {"input_ids": torch.zeros(2, 4, dtype=torch.long), "attention_mask": mask[:2],
          "labels": torch.tensor([[5, 6, -100], [7, -100, -100]])}
    assert side.count_tokens(t5, True) == (2, 5 + 3, 8 + 6)
    counting = side.Counting(
        lambda examples: {"input_ids": torch.ones(len(examples), 2, dtype=torch.long)}, False
    )
    counting([{}, {}, {}])
    assert counting.counts == [(3, 6, 6)]
