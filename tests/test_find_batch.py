"""find-batch: real steps at growing micro-batches, a memory budget with a margin, the effective
batch kept, the result read back by AUTO_BATCH=1 (validated, never executed)."""

import json

import pytest
from tiny_tools import one_thread, patch_fake_oom, summary

from conftest import run_cli
from train.config.flags import parse_training_args
from train.run.plan import adapt
from train.tools.find_batch import RESULT_FILE, TIE, find, read_saved


@pytest.fixture(autouse=True)
def _one_thread():
    yield from one_thread()


def test_fake_oom_gives_largest_safe_size_below_it_with_the_margin(tiny_flags, monkeypatch):
    # Micro-batches over 29 run out of memory. Of the divisors of 120 the search tries 1, 2, 4, 8,
    # 20, 40 (OOM), then 24 (fits) and 30 (OOM). The margin caps the answer at TARGET_VRAM x the
    # smallest size that failed, 0.6 x 30 = 18, so it measures 15 too and answers 15, although
    # 20 and 24 ran.
    patch_fake_oom(monkeypatch, limit=29)
    cfg = parse_training_args("pretrain", [*tiny_flags, "--effective_batch", "120", "--target_vram", "0.6",
                                           "--max_memory_mb", "100000"])
    lines = []
    result = find(cfg, lines.append, steps=1)
    trials = {t["batch_size"]: t for t in result.trials}
    assert all(t["status"] == "out of memory" for size, t in trials.items() if size > 29)
    assert {30, 40} <= set(trials) and trials[24]["status"] == "fits" and trials[15]["status"] == "fits"
    assert result.largest_safe == 15
    assert result.batch_size <= 15 and result.batch_size * result.gradient_accumulation_steps == 120
    safe = [t for t in trials.values() if t["status"] == "fits" and t["batch_size"] <= 15]
    # the fastest, not the largest
    assert result.samples_per_sec >= (1 - TIE) * max(t["samples_per_sec"] for t in safe)
    assert any("out of memory" in line for line in lines)


def test_cpu_budget_recommendation_trains_within_it_and_auto_batch_reuses_it(
    tiny_flags, tmp_path, monkeypatch
):
    # A budget the process's own RSS nearly fills: room for a few MB of activations, not 64 sequences.
    rss = adapt._status_mb("VmRSS")
    budget = int((rss + 40) / 0.8)
    flags = [
        *tiny_flags,
        "--batch_size",
        "8",
        "--gradient_accumulation_steps",
        "8",
        "--max_memory_mb",
        str(budget),
    ]
    assert run_cli("find-batch", *flags) == 0
    saved = json.loads((tmp_path / "runs" / RESULT_FILE).read_text())
    size, accum = saved["batch_size"], saved["gradient_accumulation_steps"]
    assert size * accum == 64 and saved["largest_safe"] < 64
    assert all(t["peak_mb"] <= 0.8 * budget for t in saved["trials"] if t["status"] == "fits")

    meter = adapt.PeakMeter(adapt.torch.device("cpu"))
    meter.reset()
    argv = [*flags, "--max_steps", "3", "--auto_batch", "1", "--run_name", "auto"]
    assert run_cli("pretrain", *argv) == 0
    peak = meter.peak_mb()
    assert peak <= budget, f"trained at peak RSS {peak:.0f} MB, over MAX_MEMORY_MB={budget}"
    s = summary(tmp_path / "runs" / "auto")
    assert (s["batch_size"], s["gradient_accumulation_steps"], s["effective_batch_size"]) == (size, accum, 64)
    log = (tmp_path / "runs" / "auto" / "train.log").read_text()
    assert f"AUTO_BATCH=1: BATCH_SIZE={size} GRADIENT_ACCUM={accum}" in log and "saved by find-batch" in log


def test_saved_result_is_validated_not_trusted(tmp_path):
    path = tmp_path / RESULT_FILE
    key = {"model": "abc"}
    cases = [
        ("not json {", "unreadable"),
        (json.dumps({"batch_size": "4; rm -rf ~", "gradient_accumulation_steps": 4, "key": key}), "no valid"),
        (json.dumps({"batch_size": True, "gradient_accumulation_steps": 16, "key": key}), "no valid"),
        (json.dumps({"batch_size": 3, "gradient_accumulation_steps": 5, "key": key}), "no valid"),
        (
            json.dumps({"batch_size": 4, "gradient_accumulation_steps": 4, "key": {"model": "other"}}),
            "changed",
        ),
    ]
    for text, reason in cases:
        path.write_text(text)
        saved, why = read_saved(path, key, 16)
        assert saved is None and reason in why
    path.write_text(json.dumps({"batch_size": 4, "gradient_accumulation_steps": 4, "key": key}))
    assert read_saved(path, key, 16)[0] == (4, 4)


def test_budget_below_one_sequence_is_one_line_naming_the_variable(tiny_flags, capsys):
    assert run_cli("find-batch", *tiny_flags, "--max_memory_mb", "64") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "MAX_MEMORY_MB" in err and "BATCH_SIZE=1" in err


def test_make_targets_take_the_launchers_variables():
    import shlex
    import subprocess

    from conftest import KIT_PY, ROOT, launch

    env = {"SHOW_COMMAND": "1", "MODEL_SIZE": "nano", "MAX_LENGTH": "128", "PRECISION": "bf16",
           "MAX_MEMORY_MB": "900", "TARGET_VRAM": "0.7", "EFFECTIVE_BATCH": "64"}
    argv = shlex.split(launch("scripts/kit.sh", env, "find-batch").stdout)
    assert (
        argv[:4] == [KIT_PY, "-m", "train", "find-batch"] and argv[argv.index("--preset") + 1] == "optimized"
    )
    for flag, value in [("--model_size", "nano"), ("--max_length", "128"), ("--precision", "bf16"),
                        ("--max_memory_mb", "900"), ("--target_vram", "0.7"), ("--effective_batch", "64")]:
        assert argv[argv.index(flag) + 1] == value
    argv = shlex.split(
        launch("scripts/kit.sh", {"SHOW_COMMAND": "1"}, "doctor", "baseline", "--apply").stdout
    )
    assert argv[argv.index("--preset") + 1] == "baseline" and argv[-1] == "--apply"
    argv = shlex.split(launch("run_single_gpu_optimized.sh", {"SHOW_COMMAND": "1", "AUTO_BATCH": "1"}).stdout)
    assert argv[argv.index("--auto_batch") + 1] == "1"
    make = subprocess.run(
        [
            "make",
            "--no-print-directory",
            "-n",
            "-o",
            ".venv/.installed",
            "find-batch",
            "doctor",
            "autotune",
            "ARGS=--apply",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert make.returncode == 0, make.stderr
    assert [line.split()[:3] for line in make.stdout.splitlines()] == [
        ["bash", "scripts/kit.sh", cmd] for cmd in ("find-batch", "doctor", "autotune")]


def test_a_run_says_when_the_saved_answer_beat_its_own_micro_batch(tiny_flags, tmp_path):
    """The kit's own answer, offered: a real find-batch, then a run at another micro-batch says
    (or not) what find-batch measured against it, from the saved trials; AUTO_BATCH=1 takes it."""
    flags = [
        *tiny_flags,
        "--batch_size",
        "1",
        "--gradient_accumulation_steps",
        "8",
        "--max_memory_mb",
        "100000",
    ]
    assert run_cli("find-batch", *flags) == 0
    path = tmp_path / "runs" / RESULT_FILE
    saved = json.loads(path.read_text())
    rate = {t["batch_size"]: t["samples_per_sec"] for t in saved["trials"] if t["status"] == "fits"}
    answer = saved["batch_size"]
    other = next(size for size in (1, 8, 2, 4) if size != answer and size in rate)
    # Whatever the machine measured, the note follows the saved figures: made slower here, the
    # run's own size is what find-batch would have beaten.
    for t in saved["trials"]:
        if t["batch_size"] == other:
            t["samples_per_sec"] = rate[answer] / 2
    path.write_text(json.dumps(saved))

    def run(name, *extra):
        argv = [*tiny_flags, "--max_memory_mb", "100000", "--max_steps", "1", "--run_name", name, *extra]
        assert run_cli("pretrain", *argv) == 0
        return (tmp_path / "runs" / name / "train.log").read_text()

    log = run("own", "--batch_size", str(other), "--gradient_accumulation_steps", str(8 // other))
    assert (
        f"find-batch measured BATCH_SIZE={answer} GRADIENT_ACCUM={8 // answer} at {rate[answer]:.1f} "
        f"samples/s on {saved['key']['device']}, 2.00x this run's {other} x {8 // other}"
    ) in log and "AUTO_BATCH=1 takes it" in log
    log = run("same", "--batch_size", str(answer), "--gradient_accumulation_steps", str(8 // answer))
    assert "find-batch measured" not in log  # already the answer: nothing to offer
    log = run("other_length", "--batch_size", str(other), "--gradient_accumulation_steps", str(8 // other),
              "--max_length", "32")
    assert "find-batch measured" not in log  # another MAX_LENGTH: the saved answer does not hold
    log = run(
        "auto",
        "--batch_size",
        str(other),
        "--gradient_accumulation_steps",
        str(8 // other),
        "--auto_batch",
        "1",
    )
    assert f"AUTO_BATCH=1: BATCH_SIZE={answer}" in log and "find-batch measured" not in log


def test_sft_auto_batch_measures_full_rows_and_trains(base_model, cache_dir, tmp_path):
    """SFT's conversations are lists of every length: find-batch measures its worst case (full
    MAX_LENGTH rows) instead of stacking them (a TypeError traceback before)."""
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Q{i}?", "response": "an answer " * (1 + i % 5)}) + "\n"
                            for i in range(40)))
    argv = ["--model_path", str(base_model), "--data_path", str(data), "--cache_dir", str(cache_dir),
            "--output_dir", str(tmp_path / "runs"), "--max_length", "64", "--batch_size", "2",
            "--gradient_accumulation_steps", "4", "--max_steps", "1", "--auto_batch", "1",
            "--max_memory_mb", "100000", "--run_name", "sft_auto"]  # fmt: skip
    assert run_cli("sft", *argv) == 0
    s = summary(tmp_path / "runs" / "sft_auto")
    assert s["effective_batch_size"] == 8 and s["steps"] == 1
    assert "AUTO_BATCH=1: BATCH_SIZE=" in (tmp_path / "runs" / "sft_auto" / "train.log").read_text()
