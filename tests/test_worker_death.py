"""A tokenizing worker killed with SIGKILL (what the out-of-memory killer does on a full machine)
fails the run in one line naming TOKENIZE_WORKERS, exit code 2, within seconds: the SFT cache
build hung forever on the lost task (multiprocessing.Pool replaces a dead worker and drops its
work). Pretraining's encoder is checked the same way. Real processes, a real kill -9."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import ROOT, make_text

WORKER_DIED = "TOKENIZE_WORKERS: a tokenizing worker process was killed (SIGKILL"


def children(pid: int) -> list[int]:
    """The processes whose parent is pid, the resource tracker left out (not a worker)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and b"resource_tracker" not in cmdline:
            found.append(int(entry.name))
    return found


def kill_a_worker_of(mode: str, argv: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    runs = tmp_path / "runs"
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR")}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "train",
            mode,
            *argv,
            "--output_dir",
            str(runs),
            "--tokenize_workers",
            "2",
            "--max_steps",
            "1",
            "--batch_size",
            "2",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline, killed = time.monotonic() + 120, None
        while killed is None and time.monotonic() < deadline and proc.poll() is None:
            workers = children(proc.pid)
            if len(workers) >= 2:
                time.sleep(0.3)  # at work on their first units
                killed = workers[0]
                os.kill(killed, signal.SIGKILL)
            time.sleep(0.01)
        assert killed is not None, "no worker appeared"
        out, err = proc.communicate(timeout=120)  # before: never returned (a hang guard, not a speed bound)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def one_line(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.stderr, (
        result.stderr[-3000:]
    )
    return lines[0]


def test_a_killed_sft_tokenize_worker_fails_the_run_in_one_line(base_model, tmp_path):
    rows = [
        {"prompt": f"Question {i}: " + make_text(i, 3), "response": make_text(i + 1, 4)} for i in range(30000)
    ]
    data = tmp_path / "big.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = kill_a_worker_of(
        "sft",
        [
            "--model_path",
            str(base_model),
            "--data_path",
            str(data),
            "--cache_dir",
            str(tmp_path / "cache"),
            "--max_length",
            "64",
        ],
        tmp_path,
    )
    assert WORKER_DIED in one_line(result)
    assert [p.name for p in (tmp_path / "cache" / "sft").iterdir() if p.name != "sums"] == []  # no half cache
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("summary.json"))


def test_a_killed_pretraining_tokenize_worker_fails_the_run_in_one_line(base_model, tiny_config, tmp_path):
    corpus = tmp_path / "big.txt"
    corpus.write_text(make_text(5, 170_000))  # ~9 MB: over the 8 MB below which one process encodes
    assert corpus.stat().st_size > 8 << 20
    result = kill_a_worker_of(
        "pretrain",
        [
            "--model_config",
            str(tiny_config),
            "--tokenizer_path",
            str(base_model),
            "--data_path",
            str(corpus),
            "--cache_dir",
            str(tmp_path / "cache"),
            "--max_length",
            "64",
        ],
        tmp_path,
    )
    assert WORKER_DIED in one_line(result)
    leftovers = [p for p in (tmp_path / "cache" / "tokens").rglob("*") if p.is_file()]
    assert leftovers == [], leftovers  # no shard was finished: nothing half written stays
