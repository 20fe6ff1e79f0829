"""compare and curves on hand-made run folders: the numbers in the table are the ones we chose."""

import json

import pytest

from train.core.errors import UsageError
from train.observe.compare import (
    compare_groups,
    compare_main,
    compare_runs,
    load_run,
    render_markdown,
    write_outputs,
)
from train.observe.curves import plot_curves

BASE = {
    "mode": "pretrain",
    "device": "cuda",
    "device_name": "Fake GPU",
    "world_size": 1,
    "model_size": "tiny",
    "n_params": 1_000_000,
    "precision": "fp32",
    "batch_size": 8,
    "gradient_accumulation_steps": 1,
    "effective_batch_size": 8,
    "max_length": 256,
    "num_workers": 0,
    "steps": 100,
    "samples": 800,
    "tokens": 204_800,
    "wall_time_s": 80.0,
    "samples_per_sec": 10.0,
    "tokens_per_sec": 2560.0,
    "step_time_ms": 800.0,
    "data_wait_frac": 0.25,
    "peak_vram_mb": 2048.0,
    "vram_total_mb": 8192.0,
    "avg_gpu_util": 31.0,
    "mfu": 0.05,
    "achieved_tflops": 1.0,
    "final_loss": 3.5,
    "final_val_loss": None,
    "exit_reason": "completed",
}


def make_run(root, name, rows=None, **overrides):
    run = root / "runs" / name
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({**BASE, "run_name": name, **overrides}))
    if rows is None:
        rows = [
            {
                "step": s,
                "samples": 8 * s,
                "tokens": 2048 * s,
                "loss": 5.0 - s / 50,
                "lr": 1e-3,
                "grad_norm": 1.0,
                "samples_per_sec": 10.0,
                "data_wait_frac": 0.2,
                "elapsed_s": s,
            }
            for s in range(1, 101)
        ]
        rows.append({"step": 100, "samples": 800, "val_loss": 3.6})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def pair(tmp_path):
    a = make_run(tmp_path, "baseline", peak_vram_mb=None, avg_gpu_util=None, mfu=None)
    b = make_run(
        tmp_path,
        "optimized",
        samples_per_sec=40.0,
        tokens_per_sec=10240.0,
        step_time_ms=3200.0,
        batch_size=32,
        gradient_accumulation_steps=4,
        effective_batch_size=128,
        precision="bf16",
        data_wait_frac=0.02,
        mfu=0.35,
        avg_gpu_util=97.5,
        final_val_loss=3.25,
    )
    return a, b


def row(md, label):
    """Cells of one table row, label excluded."""
    line = next(ln for ln in md.splitlines() if ln.startswith(f"| {label} |"))
    return [c.strip() for c in line.strip("|").split("|")][1:]


def test_two_runs_table_numbers(tmp_path):
    a, b = pair(tmp_path)
    result = compare_runs([a, b])
    base, opt = result["runs"]
    assert opt["speedup"] == pytest.approx(4.0) and base["speedup"] == 1.0
    assert opt["vram_pct"] == pytest.approx(25.0)
    assert base["peak_vram_mb"] is None and base["vram_pct"] is None
    assert opt["within_noise"] is None  # one run per side says nothing about noise
    assert result["fastest"] == "optimized"

    md = render_markdown(result)
    assert row(md, "samples/s") == ["10.0", "40.0"]
    assert row(md, "tokens/s") == ["2,560", "10,240"]
    assert row(md, "speed-up") == ["1.00x", "4.00x"]
    assert row(md, "ms/step") == ["800.0", "3,200"]
    assert row(md, "data-wait %") == ["25.0 %", "2.0 %"]
    assert row(md, "peak VRAM MB (% of total)") == ["n/a", "2,048 (25.0 %)"]
    assert row(md, "GPU util %") == ["n/a", "97.5 %"]
    assert row(md, "MFU %") == ["n/a", "35.0 %"]
    assert row(md, "effective batch (= batch x accum)") == ["8 (8 x 1)", "128 (32 x 4)"]
    assert row(md, "precision") == ["fp32", "bf16"]
    assert row(md, "final loss") == ["3.5000", "3.5000"]
    assert row(md, "final val loss") == ["n/a", "3.2500"]
    assert "optimized is 4.00x baseline (samples/s)" in md
    assert "±" not in md  # no spread for single runs


def test_missing_keys_and_slower_second_run(tmp_path):
    a = make_run(tmp_path, "a")
    b = make_run(tmp_path, "b", samples_per_sec=5.0)
    summary = json.loads((b / "summary.json").read_text())
    for key in ("tokens_per_sec", "effective_batch_size", "vram_total_mb", "precision"):
        del summary[key]
    (b / "summary.json").write_text(json.dumps(summary))
    md = render_markdown(compare_runs([a, b]))
    assert row(md, "speed-up") == ["1.00x", "0.50x"]
    assert row(md, "tokens/s") == ["2,560", "n/a"]
    assert row(md, "peak VRAM MB (% of total)") == ["2,048 (25.0 %)", "2,048"]
    assert row(md, "effective batch (= batch x accum)")[1] == "8 (8 x 1)"  # derived from batch x accum
    assert row(md, "precision")[1] == "n/a"
    assert "a is fastest: b is 0.50x a (samples/s)" in md


def test_speedup_none_when_throughput_missing(tmp_path):
    a = make_run(tmp_path, "a", samples_per_sec=None)
    b = make_run(tmp_path, "b")
    result = compare_runs([a, b])
    assert [e["speedup"] for e in result["runs"]] == [None, None]
    assert "no speed-up: samples/s missing for a" in render_markdown(result)


def test_groups_median_spread_and_noise(tmp_path):
    a = [make_run(tmp_path, f"base_r{i}", samples_per_sec=s) for i, s in enumerate((9.0, 11.0, 10.0), 1)]
    close = [
        make_run(tmp_path, f"tuned_r{i}", samples_per_sec=s) for i, s in enumerate((10.5, 13.0, 12.0), 1)
    ]
    far = [make_run(tmp_path, f"fast_r{i}", samples_per_sec=s) for i, s in enumerate((36.0, 44.0, 40.0), 1)]

    result = compare_groups([a, close])
    base, tuned = result["runs"]
    assert (base["name"], base["n"], tuned["name"]) == ("base", 3, "tuned")
    assert base["samples_per_sec"] == 10.0 and tuned["samples_per_sec"] == 12.0
    assert (base["samples_per_sec_min"], base["samples_per_sec_max"]) == (9.0, 11.0)
    assert base["samples_per_sec_spread_pct"] == pytest.approx(10.0)
    assert tuned["speedup"] == pytest.approx(1.2)
    assert tuned["within_noise"] is True
    md = render_markdown(result)
    assert row(md, "samples/s") == ["10.0 (9.0-11.0, ±10.0 %)", "12.0 (10.5-13.0, ±10.4 %)"]
    assert row(md, "speed-up") == ["1.00x", "1.20x (within noise)"]
    assert "| base (x3) | tuned (x3) |" in md
    assert result["verdict"].startswith("within noise: tuned is 1.20x base")

    result = compare_groups([a, far])
    assert result["runs"][1]["within_noise"] is False
    assert result["verdict"] == "fast is 4.00x base (samples/s)"


def test_three_runs_name_the_fastest(tmp_path):
    runs = [make_run(tmp_path, n, samples_per_sec=s) for n, s in (("a", 10.0), ("b", 40.0), ("c", 20.0))]
    result = compare_runs(runs)
    assert result["fastest"] == "b"
    assert result["verdict"] == "b is fastest: b is 4.00x a; c is 2.00x a (samples/s)"
    assert len(row(render_markdown(result), "samples/s")) == 3


def test_outputs_written_and_json_round_trips(tmp_path):
    result = compare_runs(list(pair(tmp_path)))
    paths = write_outputs(result, tmp_path / "out" / "deep")
    assert [p.name for p in paths] == ["compare.md", "compare.json", "compare.png"]
    assert json.loads(paths[1].read_text()) == result
    assert paths[0].read_text() == render_markdown(result)
    assert paths[2].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_main_default_out_dir(tmp_path, capsys):
    a, b = pair(tmp_path)
    assert compare_main([str(a), str(b)]) == 0
    out = tmp_path / "runs" / "compare" / "baseline_vs_optimized"
    assert {p.name for p in out.iterdir()} == {"compare.md", "compare.json", "compare.png"}
    printed = capsys.readouterr().out
    assert "| speed-up | 1.00x | 4.00x |" in printed and str(out / "compare.json") in printed


def test_compare_main_groups_and_usage_errors(tmp_path, capsys):
    runs = [str(make_run(tmp_path, f"r{i}")) for i in range(4)]
    assert compare_main([*runs, "--group", "2", "--out", str(tmp_path / "o")]) == 0
    assert "(x2)" in capsys.readouterr().out
    with pytest.raises(UsageError, match="multiple of 3"):
        compare_main([*runs, "--group", "3"])
    with pytest.raises(UsageError, match="at least two"):
        compare_main(runs[:1])
    with pytest.raises(UsageError, match="at least two"):
        compare_main([*runs, "--group", "4"])


def test_missing_or_bad_run_folder_names_the_path(tmp_path):
    a = make_run(tmp_path, "a")
    missing = tmp_path / "runs" / "nope"
    with pytest.raises(UsageError, match="nope"):
        compare_runs([a, missing])
    with pytest.raises(UsageError, match="nope"):
        compare_main([str(a), str(missing)])
    empty = tmp_path / "runs" / "empty"
    empty.mkdir()
    with pytest.raises(UsageError, match=r"no summary\.json in .*empty"):
        load_run(empty)
    (empty / "summary.json").write_text("{not json")
    with pytest.raises(UsageError, match=r"empty.summary\.json"):
        load_run(empty)


def test_load_run_tolerates_odd_metrics(tmp_path):
    run = make_run(tmp_path, "odd", rows=[])
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n\n[1, 2]\n{"step": 2, "lo')
    loaded = load_run(run / "summary.json")  # the file itself is accepted too
    assert loaded["name"] == "odd" and loaded["metrics"] == [{"step": 1, "loss": 2.0}]


def test_plot_curves(tmp_path):
    run = make_run(tmp_path, "a")
    png = plot_curves(run)
    assert png == run / "curves.png" and png.read_bytes()[:4] == b"\x89PNG"

    empty = make_run(tmp_path, "empty", rows=[])
    assert plot_curves(empty) is None
    assert plot_curves(tmp_path / "no_such_run") is None

    odd = make_run(tmp_path, "odd", rows=[{"step": "x", "loss": None}, {"samples": 8, "loss": "nan?"}])
    (odd / "metrics.jsonl").write_text((odd / "metrics.jsonl").read_text() + "garbage\n")
    assert plot_curves(odd) is None  # rows, but no number to plot; must not raise

    steps_only = make_run(tmp_path, "steps", rows=[{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.5}])
    assert plot_curves(steps_only) == steps_only / "curves.png"


def test_different_sample_budgets_are_flagged(tmp_path):
    a = make_run(tmp_path, "a")
    b = make_run(tmp_path, "b", samples=1024, samples_per_sec=20.0)
    md = render_markdown(compare_runs([a, b]))
    assert "note: runs differ in samples (800 vs 1024): samples/s are not like for like" in md
