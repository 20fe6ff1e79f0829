"""The suite's own control, for tests/conftest.py and the tests: Ctrl-C and SIGTERM stop every process
of `make test` (the xdist controller's handler), and the CPU time a command spends, fork-server runs
included (tests bound work by CPU seconds or counted work, never by wall time)."""

from __future__ import annotations

import os
import signal
import sys

# ---- Ctrl-C and SIGTERM stop the whole suite ---------------------------------------------------
# A terminal's Ctrl-C reaches every process of the foreground group, but not a process a test put in
# a session of its own; `kill PID` (a CI's timeout, a scheduler) reaches one process, and make passes
# a SIGTERM only to its child, the xdist controller. So the controller, which runs no test, stops
# every process under it: SIGTERM to each, then SIGKILL to what is left after STOP_GRACE_S. It is
# made a child subreaper first, so a process whose parent dies on the way (a worker's, a fork
# server's run) comes back to it instead of escaping to init.
STOP_GRACE_S = 5.0  # the kit's runs save and exit on SIGTERM; a run ignoring it is killed after this
PR_SET_CHILD_SUBREAPER = 36


def descendants(pid: int) -> list[int]:
    """Every live process under pid (zombies left out), read from /proc, nearest first."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):
            continue
        if state != "Z":
            children.setdefault(int(ppid), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(0), [])
        found += kids
        todo += kids
    return found


def stop_everything(grace_s: float = STOP_GRACE_S) -> int:
    """SIGTERM to every process under this one, SIGKILL to those left after grace_s; adopted orphans
    reaped. Returns how many processes were signalled."""
    import ctypes
    import time

    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the processes orphaned on the way may outlive the suite
    signalled: set[int] = set()
    deadline = time.monotonic() + grace_s
    while True:
        alive = descendants(os.getpid())
        if not alive:
            break
        late = time.monotonic() > deadline
        for pid in alive:
            if late or pid not in signalled:
                try:
                    os.kill(pid, signal.SIGKILL if late else signal.SIGTERM)
                except ProcessLookupError:
                    pass
                signalled.add(pid)
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass
        time.sleep(0.05)
    return len(signalled)


def stop_the_suite(number, _frame) -> None:
    """The controller's handler: every process under it stopped, then this one dies of the signal."""
    name = signal.Signals(number).name
    print(f"\n{name}: stopping every process of the test suite ...", file=sys.stderr, flush=True)
    stopped = stop_everything()
    print(f"{name}: {stopped} processes stopped", file=sys.stderr, flush=True)
    signal.signal(number, signal.SIG_DFL)
    os.kill(os.getpid(), number)  # die of it, as make and a shell expect



def install(controller: bool) -> None:
    """SIGTERM and SIGHUP stop the whole suite; SIGINT too in the xdist controller (in a plain pytest
    run Ctrl-C stays pytest's KeyboardInterrupt, which ends the running test's subprocesses)."""
    for number in (signal.SIGTERM, signal.SIGHUP, *((signal.SIGINT,) if controller else ())):
        signal.signal(number, stop_the_suite)


# ---- CPU time, where a test bounds the work a command does -----------------------------------------
# A test bounds work by CPU seconds, never by wall time: on 2 cores shared by several suites a wall
# bound fails with the kit behaving right (a render bound's 90 s took 102 s at load 9-16).


def cpu_now() -> float:
    """CPU seconds of this process and its reaped children."""
    import resource
    import time

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


class CpuSpent:
    """`with CpuSpent() as cpu: ...; cpu.spent`: CPU seconds spent since the start by this process,
    its children and the fork server's runs started for them (tests/forkserver.py's caller adds each
    run's CPU to KIT_CPU_LOG: the run is the server's child, not the test's)."""

    def __enter__(self):
        import tempfile

        fd, self.log = tempfile.mkstemp(prefix="kit-cpu-")
        os.close(fd)
        self.before, self.old = cpu_now(), os.environ.get("KIT_CPU_LOG")
        os.environ["KIT_CPU_LOG"] = self.log
        return self

    def seconds(self) -> float:
        with open(self.log) as f:
            runs = [float(x) for x in f.read().split()]
        self.forked_runs = len(runs)  # how many fork-server runs reported theirs
        return cpu_now() - self.before + sum(runs)

    def __exit__(self, *exc):
        self.spent = self.seconds()
        if self.old is None:
            os.environ.pop("KIT_CPU_LOG", None)
        else:
            os.environ["KIT_CPU_LOG"] = self.old
        os.unlink(self.log)
        return False
