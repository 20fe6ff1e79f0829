"""tests/forkserver.py, the warm parent of the suite's `python -m train` processes, held to what the real
interpreter does: a forked run gives back its output and exit status, sees the caller's environment and
folder, dies with its signal when it crashes, ends when its caller is killed, and leaves no process behind.
A caller whose run may not be forked becomes the real interpreter. The runs here are the CLI's cheap
paths (usage, a refused flag, a torchrun agent waiting for a second node), not training runs."""

from __future__ import annotations

import array
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import forkserver
import pytest

from conftest import CLEAN_ENV, ROOT, fork_server


@pytest.fixture(scope="module")
def server() -> dict:
    """This pytest process's server (the suite's runs use it), listening: {"python", "env", "pid", "path"}."""
    started = fork_server()
    path = started["env"]["KIT_FORKSERVER"]
    assert forkserver.ready(path, wait_s=600), (
        "the fork server did not start"
    )  # its imports, on a loaded machine
    return {**started, "pid": started["server"].pid, "path": path}


def caller_env(server: dict, tmp_path: Path, **extra: str) -> dict:
    """The server's own environment (a clean one, as launcher tests use), the caller's CPU log, `extra`."""
    base = {k: v for k, v in os.environ.items() if k in CLEAN_ENV}
    return {
        **base,
        "PYTHONPATH": str(ROOT),
        **server["env"],
        "KIT_CPU_LOG": str(tmp_path / "cpu.log"),
        **extra,
    }


def forked_runs(tmp_path: Path) -> int:
    """How many runs the server forked for callers with this env: each caller logs its run's CPU seconds."""
    log = tmp_path / "cpu.log"
    return len(log.read_text().split()) if log.exists() else 0


def children(pid: int) -> dict[int, str]:
    """{pid: state} of pid's children, zombies included (a run the server forgot to reap shows as Z)."""
    found = {}
    for entry in os.listdir("/proc"):
        try:
            state, ppid = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):
            continue
        if int(ppid) == pid:
            found[int(entry)] = state
    return found


def settle(server: dict, before: dict, timeout: float = 60.0) -> dict:
    """The server's children once those started since `before` are gone and reaped (or the timeout)."""
    deadline = time.monotonic() + timeout
    while set(children(server["pid"])) - set(before) and time.monotonic() < deadline:
        time.sleep(0.05)
    return {pid: state for pid, state in children(server["pid"]).items() if pid not in before}


def run(
    argv: list[str], env: dict, cwd: Path = ROOT, python: str | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run([python or sys.executable, *argv], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=300)  # fmt: skip


def test_a_forked_run_gives_back_what_the_interpreter_would(server, tmp_path):
    """Usage on stdout with 0, a refused flag's one line on stderr with 2: the same bytes and status as the
    real interpreter's, and each run was a fork (its caller logged its CPU)."""
    env = caller_env(server, tmp_path)
    before = children(server["pid"])
    for argv in (["-m", "train", "--help"], ["-m", "train", "pretrain", "--batch_size", "abc"]):
        forked, real = run(argv, env, python=server["python"]), run(argv, env)
        assert (forked.returncode, forked.stdout, forked.stderr) == (
            real.returncode,
            real.stdout,
            real.stderr,
        )
    assert forked.returncode == 2 and "BATCH_SIZE" in forked.stderr and len(forked.stderr.splitlines()) == 1
    assert "usage: python -m train" in run(["-m", "train", "--help"], env).stdout
    assert forked_runs(tmp_path) == 2
    assert settle(server, before) == {}  # reaped: no zombie, nothing left running


def test_the_run_has_the_callers_environment_and_folder(server, tmp_path):
    """RANK is read when the run starts (train/cli.py): the server's own environment has none. A relative
    run folder is found from the caller's folder, not the server's (the kit's)."""
    env = caller_env(server, tmp_path)
    bad_rank = run(["-m", "train", "pretrain"], {**env, "RANK": "x5"}, python=server["python"])
    assert (
        bad_rank.returncode == 2
        and "RANK: expected a whole number >= 0 (set by torchrun), got 'x5'" in bad_rank.stderr
    )
    (tmp_path / "A").mkdir()  # a folder without summary.json: here it is found, in the kit's folder it is not
    here = run(["-m", "train", "compare", "A", "A"], env, cwd=tmp_path, python=server["python"])
    assert here.returncode == 2 and "no summary.json in A" in here.stderr, here.stderr
    there = run(["-m", "train", "compare", "A", "A"], env, cwd=ROOT, python=server["python"])
    assert there.returncode == 2 and "run folder not found: A" in there.stderr, there.stderr
    assert forked_runs(tmp_path) == 3


def test_what_may_not_be_forked_runs_in_the_real_interpreter(server, tmp_path):
    """An import-time variable of the caller's own (PYTHONHASHSEED), or a command other than -m train:
    the caller execs the real interpreter, with the same result and no fork."""
    env = caller_env(server, tmp_path)
    seeded = run(
        ["-m", "train", "pretrain", "--batch_size", "0"],
        {**env, "PYTHONHASHSEED": "7"},
        python=server["python"],
    )
    assert seeded.returncode == 2 and "BATCH_SIZE" in seeded.stderr
    code = "import os, sys; print(os.getcwd(), os.environ['PROBE']); sys.exit(3)"
    plain = run(["-c", code], {**env, "PROBE": "p1"}, cwd=tmp_path, python=server["python"])
    assert (plain.returncode, plain.stdout) == (3, f"{tmp_path} p1\n")
    assert forked_runs(tmp_path) == 0


def waiting_run(server: dict, env: dict, cwd: Path) -> tuple[subprocess.Popen, int]:
    """A caller whose forked run waits (torchrun's agent, for a second node never to come): (caller, pid)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    before = children(server["pid"])
    caller = subprocess.Popen([server["python"], "-m", "train.distributed.torchrun", "--nnodes", "2",
                               "--nproc_per_node", "1", "--rdzv_backend", "c10d", "--rdzv_endpoint",
                               f"127.0.0.1:{port}", "--module", "train", "pretrain"], env=env, cwd=cwd,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 300  # a hang guard: a loaded machine
    while not (new := set(children(server["pid"])) - set(before)) and caller.poll() is None:
        assert time.monotonic() < deadline, "no run forked"
        time.sleep(0.05)
    assert caller.poll() is None, caller.stderr.read()
    (pid,) = new
    return caller, pid


def test_a_crashed_run_is_its_callers_death_and_a_killed_caller_takes_its_run(server, tmp_path):
    """A run that dies of SIGSEGV (a crash in native code): its caller dies of SIGSEGV too, as a parent
    sees its own child die. A caller killed by SIGKILL (no handler can pass it on): its run ends as well.
    Both runs are reaped by the server."""
    env = caller_env(server, tmp_path)
    before = children(server["pid"])
    caller, pid = waiting_run(server, env, tmp_path)
    os.kill(pid, signal.SIGSEGV)
    assert caller.wait(timeout=60) == -signal.SIGSEGV
    caller, pid = waiting_run(server, env, tmp_path)
    os.kill(caller.pid, signal.SIGKILL)
    caller.wait(timeout=60)
    assert settle(server, before) == {}, f"left behind: {children(server['pid'])}"
    assert not Path(f"/proc/{pid}").exists()


def test_a_caller_signal_reaches_its_run(server, tmp_path):
    """SIGTERM to the caller (a `kill`, or pytest's stop) is passed to the run, which ends by it; the
    caller then ends as its run did."""
    env = caller_env(server, tmp_path)
    before = children(server["pid"])
    caller, pid = waiting_run(server, env, tmp_path)
    os.kill(caller.pid, signal.SIGTERM)
    code = caller.wait(timeout=120)
    assert settle(server, before) == {} and not Path(f"/proc/{pid}").exists()
    assert code != 0 and forked_runs(tmp_path) == 1  # the run's own status: torchrun's agent on SIGTERM


def test_a_run_that_raises_reports_its_traceback_and_exit_1(server, tmp_path):
    """The server's side of the protocol alone (the caller forks only the kit's modules): a module that
    cannot be run raises in the child, whose traceback goes to the caller's stderr and status 1 back."""
    request = {"module": "train.no_such_module", "argv": [], "env": caller_env(server, tmp_path),
               "cwd": str(tmp_path), "unbuffered": True, "limits": forkserver.limits(),
               "ignored": []}  # fmt: skip
    before = children(server["pid"])
    with open(os.devnull) as stdin, open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(server["path"])
            fds = array.array("i", [stdin.fileno(), out.fileno(), err.fileno()])
            conn.sendmsg(
                [json.dumps(request).encode() + b"\n"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)]
            )
            lines = conn.makefile("r")
            first, last = lines.readline().split(), lines.readline().split()
    assert first[0] == "pid" and last[0] == "exit"
    assert os.waitstatus_to_exitcode(int(last[1])) == 1 and float(last[2]) >= 0
    text = (tmp_path / "err").read_text()
    assert "Traceback" in text and "No module named train.no_such_module" in text, text
    assert settle(server, before) == {}
