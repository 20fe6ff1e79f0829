"""Ctrl-C and SIGTERM stop the whole of `make test` (the issue: shard 1 ignored SIGINT three times and a
SIGTERM). A planted suite runs through the Makefile's own test target on a copy of the kit's test
machinery: one test waits in a run forked by its worker's fork server (torchrun's rendezvous for a
second node that never comes), the other in a process it put in a session of its own and in a shell
that ignores SIGTERM and SIGINT. Once all of them are up, a terminal's Ctrl-C (SIGINT to make's process
group) or a `kill` of make (SIGTERM to make alone, which passes it to its child) must end every one."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from suite_control import descendants

from conftest import ROOT, TESTS

FORKED = """
import os
import socket
import subprocess
import time

from conftest import ROOT, fork_server, train_python
from suite_control import descendants


def test_a_run_forked_by_the_fork_server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rendezvous = ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}"]
    run = subprocess.Popen([train_python(), "-m", "train.distributed.torchrun", "--nnodes", "2",
                            "--nproc_per_node", "1", *rendezvous, "--module", "train", "pretrain"], cwd=ROOT)
    server = fork_server()["server"].pid
    deadline = time.monotonic() + 300  # a hang guard: the server's imports, on a loaded machine
    while not descendants(server) and time.monotonic() < deadline:
        time.sleep(0.1)
    with open(os.environ["PLANTED_READY"], "a") as f:
        f.write(f"forked {server} {' '.join(map(str, descendants(server)))}\\n")
    run.wait()
"""
STUBBORN = '''
import os
import subprocess


def test_processes_that_a_group_signal_misses_or_that_ignore_it():
    alone = subprocess.Popen(["sleep", "600"], start_new_session=True)
    deaf = subprocess.Popen(["bash", "-c", "trap '' TERM INT; sleep 600 & wait"])
    with open(os.environ["PLANTED_READY"], "a") as f:
        f.write(f"stubborn {alone.pid} {deaf.pid}\\n")
    deaf.wait()
'''


def planted_kit(tmp_path: Path) -> Path:
    """The kit's Makefile, test machinery and code (linked), with the two planted test modules."""
    kit = tmp_path / "kit"
    (kit / "tests").mkdir(parents=True)
    for name in ("conftest.py", "suite_control.py", "forkserver.py"):
        shutil.copy(TESTS / name, kit / "tests" / name)
    (kit / "tests" / "test_forked.py").write_text(FORKED)
    (kit / "tests" / "test_stubborn.py").write_text(STUBBORN)
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, kit / name)
    for name in ("train", "config.py", "requirements.txt", "scripts"):
        (kit / name).symlink_to(ROOT / name)
    (kit / ".venv").symlink_to((ROOT / ".venv").resolve())
    return kit


def start_time(pid: int) -> str | None:
    """A process's start time (its identity against a reused pid), None when it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields[19]


def marked(mark: str, kit: Path) -> list[int]:
    """Live processes that belong to the planted suite: its mark in their environment, or its folder in
    their command line (the fork server starts from a clean environment)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or start_time(int(entry)) is None:
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if mark.encode() in environ or str(kit).encode() in cmdline:
            found.append(int(entry))
    return found


@pytest.mark.parametrize("how", ["ctrl-c", "kill"])
def test_ctrl_c_and_sigterm_stop_every_process_of_make_test(tmp_path, how):
    kit = planted_kit(tmp_path)
    ready, mark = tmp_path / "ready.txt", f"planted-{uuid.uuid4().hex}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KIT_", "PYTEST_"))}
    env.update(PLANTED_READY=str(ready), PLANTED_MARK=mark)
    log = open(tmp_path / "make.log", "w")  # noqa: SIM115 (closed below)
    make = subprocess.Popen(["make", "-o", ".venv/.installed", "test"], cwd=kit, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 400  # a hang guard: two workers and a fork server start
        while make.poll() is None and time.monotonic() < deadline:
            lines = ready.read_text().splitlines() if ready.exists() else []
            if len(lines) == 2 and all(len(line.split()) > 2 for line in lines):
                break
            time.sleep(0.2)
        assert make.poll() is None, (tmp_path / "make.log").read_text()
        planted = {
            line.split()[0]: [int(p) for p in line.split()[1:]] for line in ready.read_text().splitlines()
        }
        suite = descendants(make.pid)
        pids = {pid: start_time(pid) for pid in suite}
        server, *runs = planted["forked"]
        assert server in suite and runs and set(runs) <= set(suite), (planted, suite)
        assert set(planted["stubborn"]) <= set(suite)
        # the controller, 2 workers, the server, its run, the caller, sleep, bash (+ sleep)
        assert len(suite) >= 8

        if how == "ctrl-c":
            os.killpg(make.pid, signal.SIGINT)  # as a terminal does: the foreground group, not other sessions
        else:
            os.kill(make.pid, signal.SIGTERM)  # as `kill` does: make alone
        make.wait(timeout=120)  # a hang guard; the stop itself takes about STOP_GRACE_S
    finally:
        if make.poll() is None:
            os.killpg(make.pid, signal.SIGKILL)
            make.wait()
        log.close()
    out = (tmp_path / "make.log").read_text()
    print(out)
    assert make.returncode != 0
    assert re.search(r"SIG(INT|TERM): \d+ processes stopped", out), out
    left = [pid for pid, started in pids.items() if started is not None and start_time(pid) == started]
    assert left == [], f"still running after make ended: {left}\n{out}"
    assert marked(mark, kit) == []


def test_cpu_spent_counts_a_run_forked_by_the_fork_server(tiny_flags):
    """A test's CPU bound (CpuSpent) covers a `python -m train` run that the fork server forked: the
    run is the server's child, so its CPU reaches the test only through the caller's report."""
    from suite_control import CpuSpent

    from conftest import forking, train_python

    argv = [train_python(), "-m", "train", "pretrain", "--dry_run", *tiny_flags]
    with CpuSpent() as cpu:
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert cpu.spent > 0.05
    assert cpu.forked_runs == (1 if forking() else 0)
