"""Two processes through the launcher (torchrun, gloo): a run stopped by SIGTERM to torchrun and
one whose rank 1 is SIGKILLed, each resumed with RESUME=1, repeat the uninterrupted run's
samples and losses step for step; SHARDING=zero2 and zero3 (with OFFLOAD_OPTIMIZER=1) resume
from their sharded checkpoints the same way.

All runs of a phase start at once (torch imports overlap), so the module costs about as much
as its slowest run, not their sum."""

import json
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, launcher_env, read_jsonl
from train.run.checkpoint import on_disk

STEPS = 12
EFFECTIVE = 4 * 2 * 2  # BATCH_SIZE x GRADIENT_ACCUM x 2 processes
TIMEOUT = 420


@pytest.fixture(scope="module")
def env(corpus, tiny_config, cache_dir, tmp_path_factory):
    runs = tmp_path_factory.mktemp("ddp_resume") / "runs"
    # the ranks through the tests' fork server (KIT_PYTHON): torchrun's children are its callers
    base = launcher_env({})
    base.update(
        NPROC_PER_NODE="2", MODEL_CONFIG=str(tiny_config), DATA_PATH=str(corpus), VOCAB_SIZE="512",
        CACHE_DIR=str(cache_dir), OUTPUT_DIR=str(runs), MAX_LENGTH="64", BATCH_SIZE="4", GRADIENT_ACCUM="2",
        NUM_WORKERS="0", MAX_STEPS=str(STEPS), SAVE_EVERY="3", KEEP_CHECKPOINTS="20", LOG_EVERY="1",
        SEED="5", OMP_NUM_THREADS="1",
    )  # fmt: skip
    return runs, base


def start(base: dict, name: str, **extra) -> subprocess.Popen:
    # Its own session: a signal meant for this run never reaches pytest.
    proc = subprocess.Popen(
        ["bash", str(ROOT / "run_single_gpu_optimized.sh")], env={**base, "RUN_NAME": name, **extra},
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    proc.run_name = name
    return proc


def finish(proc: subprocess.Popen) -> dict:
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        for pid in workers(proc.run_name).values():
            os.kill(pid, signal.SIGKILL)
        pytest.fail(f"a 2-process run did not finish in {TIMEOUT} s (a hung collective?)")
    return {"rc": proc.returncode, "out": out, "err": err}


def workers(run_name: str) -> dict[int, int]:
    """rank -> pid of the run's rank processes: those whose environment names the run and a rank
    (torchrun's children; with the tests' fork server, the callers that stand for the ranks, whose
    runs die with them)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RUN_NAME={run_name}".encode() not in environ:
            continue
        for item in environ:
            if item.startswith(b"RANK="):
                found[int(item[5:])] = int(entry.name)
    return found


def losses(run: Path) -> list[dict]:
    return [r for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]


def assert_same_run(run: Path, reference: Path, resumed_from: int) -> None:
    rows, ref = losses(run), losses(reference)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # one row per step: none lost or repeated
    assert (
        [r["samples"] for r in rows]
        == [r["samples"] for r in ref]
        == [EFFECTIVE * s for s in range(1, STEPS + 1)]
    )
    after = [(a["loss"], b["loss"]) for a, b in zip(rows, ref, strict=True) if a["step"] > resumed_from]
    assert len(after) == STEPS - resumed_from > 0
    np.testing.assert_allclose([a for a, _ in after], [b for _, b in after], rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def stopped(env):
    """Phase 1, all at once: the uninterrupted reference, a run SIGTERMed (torchrun passes it to
    both ranks) and a run whose rank 1 is SIGKILLed, each at a random step; and the sharded
    references."""
    runs, base = env
    procs = {
        "ref": start(base, "ref"),
        "termed": start(base, "termed"),
        "killed": start(base, "killed"),
        "zero2": start(base, "zero2", SHARDING="zero2", MAX_STEPS="6"),
        "zero3": start(base, "zero3", SHARDING="zero3", OFFLOAD_OPTIMIZER="1", MAX_STEPS="6"),
    }
    at = {"termed": random.randint(4, 8), "killed": random.randint(4, 8)}
    pending, deadline = dict(at), time.monotonic() + TIMEOUT
    while pending and time.monotonic() < deadline:
        for name, step in list(pending.items()):
            metrics = runs / name / "metrics.jsonl"
            rows = len(metrics.read_text().splitlines()) if metrics.exists() else 0
            if procs[name].poll() is not None:
                pytest.fail(f"{name} ended before step {step}: {procs[name].stderr.read()[-6000:]}")
            if rows >= step:
                if name == "termed":
                    os.kill(procs[name].pid, signal.SIGTERM)  # torchrun itself, as a scheduler does
                else:
                    os.kill(workers(name)[1], signal.SIGKILL)  # a rank dies
                del pending[name]
        time.sleep(0.01)
    results = {name: finish(proc) for name, proc in procs.items()}
    for name, result in results.items():
        path = runs / name / "summary.json"
        result["summary"] = json.loads(path.read_text()) if path.exists() else None
    assert not pending, f"no step {pending} within {TIMEOUT} s"
    return runs, base, results, at


@pytest.fixture(scope="module")
def resumed(stopped):
    """Phase 2, all at once: RESUME=1 of the stopped runs; the sharded runs resume from a copy
    stopped after their first checkpoint (step 3 of 6)."""
    runs, base, results, _ = stopped
    for name in ("zero2", "zero3"):
        copy = runs / f"{name}-resumed"
        shutil.copytree(runs / name, copy, symlinks=True)
        for path in on_disk.list_checkpoints(copy / "checkpoints")[:-1]:
            shutil.rmtree(path)  # keep step 3 only
        for leftover in ("summary.json", "final"):
            shutil.rmtree(copy / leftover) if (copy / leftover).is_dir() else (copy / leftover).unlink()
    procs = {
        "termed": start(base, "termed", RESUME="1"),
        "killed": start(base, "killed", RESUME="1"),
        "zero2-resumed": start(base, "zero2-resumed", RESUME="1", SHARDING="zero2", MAX_STEPS="6"),
        "zero3-resumed": start(
            base, "zero3-resumed", RESUME="1", SHARDING="zero3", OFFLOAD_OPTIMIZER="1", MAX_STEPS="6"
        ),
    }
    return {name: finish(proc) for name, proc in procs.items()}


def summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def test_two_process_run_writes_one_set_of_outputs(stopped):
    runs, base, results, _ = stopped
    assert results["ref"]["rc"] == 0, results["ref"]["err"][-3000:]
    s = summary(runs / "ref")
    assert (
        s["world_size"] == 2 and s["effective_batch_size"] == EFFECTIVE and s["samples"] == EFFECTIVE * STEPS
    )
    assert [r["rank"] for r in s["per_rank"]] == [0, 1] and all(r["peak_rss_mb"] > 0 for r in s["per_rank"])
    assert "x 2 processes = effective 16" in (runs / "ref" / "train.log").read_text()
    assert results["ref"]["out"].count("done:") == 1  # rank 0 alone prints
    assert (runs / "ref" / "final" / "model.safetensors").exists()
    again = start(base, "ref", MAX_STEPS="1")  # the folder exists: refused on every rank, one line
    bad = finish(again)
    assert bad["rc"] == 2 and "OVERWRITE=1" in bad["err"] and "Traceback" not in bad["err"]


def test_sigterm_to_torchrun_stops_every_rank_at_one_step_and_resumes(stopped, resumed):
    runs, _, results, at = stopped
    termed = results["termed"]
    assert termed["rc"] == 128 + signal.SIGTERM, termed["err"][-3000:]
    assert "Traceback" not in termed["err"] and "death signal" not in termed["err"], termed["err"][-6000:]
    s = termed["summary"]  # both ranks stopped at the same step, saved, wrote the summary
    assert s["exit_reason"] == "interrupted" and s["stop_signal"] == "SIGTERM"
    stopped_at = s["steps"]
    assert at["termed"] <= stopped_at < STEPS and s["checkpoint"] == on_disk.checkpoint_name(stopped_at)
    meta = json.loads((runs / "termed" / "checkpoints" / s["checkpoint"] / "meta.json").read_text())
    assert meta["data"]["world_size"] == 2 and meta["data"]["position"] == EFFECTIVE * stopped_at
    assert resumed["termed"]["rc"] == 0, resumed["termed"]["err"][-3000:]
    assert summary(runs / "termed")["resumed_from_step"] == stopped_at
    assert_same_run(runs / "termed", runs / "ref", stopped_at)


def test_sigkill_of_one_rank_then_resume_repeats_and_skips_no_sample(stopped, resumed):
    runs, _, results, at = stopped
    killed = results["killed"]
    assert killed["rc"] == 1 and not killed["summary"]  # died, wrote nothing more
    # what the user reads: which rank died and how, and what to run; no traceback per rank
    assert "rank 1 was killed by SIGKILL" in killed["err"] and "RESUME=1" in killed["err"]
    assert "Traceback" not in killed["err"], killed["err"][-3000:]
    assert resumed["killed"]["rc"] == 0, resumed["killed"]["err"][-3000:]
    resumed_from = summary(runs / "killed")["resumed_from_step"]
    assert 3 <= resumed_from <= at["killed"] + 3 and resumed_from % 3 == 0
    assert_same_run(runs / "killed", runs / "ref", resumed_from)


@pytest.mark.parametrize("sharding", ["zero2", "zero3"])
def test_sharded_run_resumes_from_its_checkpoint(sharding, stopped, resumed):
    runs, _, results, _ = stopped
    assert results[sharding]["rc"] == 0, results[sharding]["err"][-3000:]
    saved = runs / sharding / "checkpoints" / "step-00000003"
    assert (saved / "shards" / ".metadata").exists() and not (saved / "model.safetensors").exists()
    assert len(list((saved / "shards").glob("*.distcp"))) == 2  # one file of shards per rank
    run = runs / f"{sharding}-resumed"
    assert resumed[run.name]["rc"] == 0, resumed[run.name]["err"][-3000:]
    assert summary(run)["resumed_from_step"] == 3 and summary(run)["world_size"] == 2
    rows, ref = losses(run), losses(runs / sharding)
    assert [r["samples"] for r in rows] == [r["samples"] for r in ref] == [EFFECTIVE * s for s in range(1, 7)]
    np.testing.assert_allclose([r["loss"] for r in rows], [r["loss"] for r in ref], rtol=0, atol=1e-5)
    assert (run / "final" / "model.safetensors").exists()
