"""A warm parent for the suite's `python -m train` processes (tests only).

A test that runs the kit as a user does (a launcher, or `python -m train` in a process of its own)
pays the imports first: torch, transformers and the kit take ~7 s of one core on the 2-core host,
most of a short run. The server imports them once, then forks one child per run: the child takes
the caller's stdin, stdout and stderr (passed over a Unix socket), environment, working folder
and arguments, runs `python -m train ...` as the interpreter would, and the caller (`client`,
which stands where the interpreter would: KIT_PYTHON for the launchers, TRAIN_PYTHON for the tests'
own commands) exits with its status, or dies of its signal. Signals sent to the caller are passed
on; a caller killed by SIGKILL takes its child with it, and the server's end (its pytest process
gone, a SIGTERM) takes all of its children. The run is the server's child, not the caller's, so the
caller adds the run's CPU seconds to the file KIT_CPU_LOG names (tests/suite_control.py's CpuSpent).

Only plain runs take this path: `-m train` (or `-m train.distributed.torchrun`, whose ranks are
callers in their turn) with no interpreter flag but -u, and an environment
whose import-time variables (Python's, torch's, Hugging Face's, threads', HOME, locale) are the
server's own. Anything else, or no server, and the caller becomes the real interpreter (exec),
so a test never depends on the server. The caller's resource limits (RLIMIT_FSIZE ...) and an
ignored SIGXFSZ become the child's. Tests that read the run's process tree use the real
interpreter.

    python tests/forkserver.py serve SOCKET     the server (conftest starts one per pytest process and
                                                writes its pid to SOCKET.pid: callers wait while it starts)
    python tests/forkserver.py [-u] -m train ...  the caller (or -m train.distributed.torchrun ...)
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys

# the kit the server imports: this checkout, or a copy of it (KIT_FORKSERVER_ROOT, conftest's fork_server)
ROOT = os.environ.get("KIT_FORKSERVER_ROOT") or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# what an import may read once and keep: a run whose values differ runs in a fresh interpreter
SENSITIVE = (
    "PYTHON",
    "HF_",
    "HUGGINGFACE",
    "TRANSFORMERS",
    "TORCH",
    "PYTORCH",
    "OMP_",
    "MKL_",
    "KMP_",
    "CUDA",
    "NCCL",
    "TOKENIZERS",
    "MPL",
    "XDG_",
    "LD_",
    "LC_",
    "TRITON",
    "SAFETENSORS",
    "ACCELERATE",
    "NVIDIA",
)
SENSITIVE_NAMES = ("HOME", "LANG", "TMPDIR", "USE_TF", "USE_TORCH", "USE_FLAX")
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


# what a caller may run as a fork: the kit, and torchrun as the launchers start it (its ranks are callers too)
MODULES = ("train", "train.distributed.torchrun")

# torchrun's settings for its ranks, read by torch.distributed when a rank starts, not on import
RANK_SETTINGS = ("TORCHELASTIC_", "TORCH_ELASTIC_", "TORCH_NCCL_")


def sensitive(env: dict) -> dict:
    return {
        k: v
        for k, v in env.items()
        if (k.startswith(SENSITIVE) or k in SENSITIVE_NAMES) and not k.startswith(RANK_SETTINGS)
    }


def comparable(env: dict) -> dict:
    """The import-time view of an environment: PYTHONUNBUFFERED is the caller's to choose, and a
    PYTHONPATH of the kit's folder is what the server has on its path anyway."""
    env = sensitive(env)
    env.pop("PYTHONUNBUFFERED", None)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # whether .pyc files are written, not what is imported
    env.pop("OMP_NUM_THREADS", None)  # the child sets torch's threads from it (child())
    if "TORCHINDUCTOR_CACHE_DIR" in env and env["TORCHINDUCTOR_CACHE_DIR"] == inductor_default():
        # torch writes its default here once inductor is used in the caller's process
        del env["TORCHINDUCTOR_CACHE_DIR"]
    parts = [p for p in env.pop("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != ROOT]
    if parts:
        env["PYTHONPATH"] = os.pathsep.join(parts)
    return env


def inductor_default() -> str:
    """torch._inductor's cache folder when TORCHINDUCTOR_CACHE_DIR is unset (cache_dir_utils)."""
    import getpass
    import re
    import tempfile

    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    return os.path.abspath(
        os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))
    )


# what a caller may have set for its run (a test's preexec_fn): the child takes them as its own
LIMITS = ("RLIMIT_FSIZE", "RLIMIT_AS", "RLIMIT_DATA", "RLIMIT_NOFILE", "RLIMIT_CPU")
# ignored by the caller, so by the run: a write past RLIMIT_FSIZE fails with EFBIG
IGNORABLE = (signal.SIGXFSZ,)


def limits() -> dict:
    import resource

    return {name: list(resource.getrlimit(getattr(resource, name))) for name in LIMITS}


def within(mine: dict, server: dict) -> bool:
    """Whether a child of the server can take the caller's limits: none above the server's hard one."""
    from resource import RLIM_INFINITY as inf

    return all(
        server[name][1] == inf or (mine[name][1] != inf and mine[name][1] <= server[name][1])
        for name in LIMITS
    )


# ---------------------------------------------------------------- server


def serve(path: str) -> None:
    sys.path.insert(0, ROOT)
    parent = os.getppid()
    before = comparable(dict(os.environ))  # as the caller's is: before any import sets its own
    import torch  # noqa: F401
    import torch.distributed.run  # noqa: F401
    import transformers  # noqa: F401
    from matplotlib import figure  # noqa: F401
    from matplotlib.backends import backend_agg  # noqa: F401
    from transformers.models.gpt2 import modeling_gpt2  # noqa: F401
    from transformers.models.llama import modeling_llama  # noqa: F401
    from transformers.models.t5 import modeling_t5  # noqa: F401

    import train.__main__  # noqa: F401
    import train.cli  # noqa: F401
    import train.distributed.torchrun  # noqa: F401
    import train.run.pipeline  # noqa: F401
    import train.run.plan.build  # noqa: F401

    for name in ("train.__main__", "train.distributed.torchrun"):
        sys.modules.pop(name, None)  # each child runs its module as __main__ (runpy warns if it is there)

    with open(path + ".env", "w") as out:
        json.dump({"env": before, "limits": limits()}, out)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    os.replace(path + ".tmp", path)  # callers see the socket only once it is bound
    listener.listen(64)
    listener.settimeout(0.05)
    children: dict[int, socket.socket] = {}

    def stop(number, _frame) -> None:  # SIGTERM, SIGHUP: through the finally below, not a silent death
        raise SystemExit(128 + number)

    for number in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(number, stop)  # (each run puts FORWARDED back to the defaults: child())
    try:
        loop(listener, children, parent)
    finally:  # whatever ends the server (its pytest gone, a signal), its runs end with it
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def loop(listener: socket.socket, children: dict, parent: int) -> None:
    """Accept callers and fork their runs while the pytest process that started the server lives;
    each run's exit status and CPU seconds go back to its caller."""
    while os.getppid() == parent:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            conn = None
        if conn is not None:
            conn.settimeout(None)
            try:
                request, fds = receive(conn)
            except (OSError, ValueError):
                conn.close()
                request = None
            if request is not None:
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    for other in children.values():
                        other.close()
                    child(conn, request, fds)  # never returns
                for fd in fds:
                    os.close(fd)
                children[pid] = conn
                try:
                    conn.sendall(f"pid {pid}\n".encode())
                except OSError:
                    pass
        while children:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:  # the run's CPU: its own and its reaped children's (tokenizer workers ...)
                    conn.sendall(f"exit {status} {usage.ru_utime + usage.ru_stime:.3f}\n".encode())
                except OSError:
                    pass
                conn.close()


def receive(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds = b"", []
    while not data.endswith(b"\n"):
        msg, ancdata, _, _ = conn.recvmsg(1 << 20, socket.CMSG_SPACE(3 * 4))
        if not msg:
            raise ValueError("the caller went away")
        data += msg
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds += list(memoryview(payload).cast("i"))
    return json.loads(data), fds


def child(conn: socket.socket, request: dict, fds: list[int]) -> None:
    """In the forked child: become `python [-u] -m MODULE ARGS` for the caller, then exit."""
    import atexit
    import io
    import runpy
    import threading
    import traceback

    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        unbuffered = request["unbuffered"]
        sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
        sys.stdout = sys.__stdout__ = io.TextIOWrapper(
            io.FileIO(1, "w", closefd=False),
            encoding="utf-8",
            line_buffering=os.isatty(1),
            write_through=unbuffered,
        )
        sys.stderr = sys.__stderr__ = io.TextIOWrapper(
            io.FileIO(2, "w", closefd=False),
            encoding="utf-8",
            errors="backslashreplace",
            line_buffering=True,
            write_through=unbuffered,
        )
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        import resource

        for name, (soft, hard) in request["limits"].items():
            resource.setrlimit(getattr(resource, name), (soft, hard))
        for number in request["ignored"]:
            signal.signal(number, signal.SIG_IGN)
        threads = os.environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:  # OpenMP read it when torch was loaded, in the server
            import torch

            torch.set_num_threads(int(threads))
        for sig in FORWARDED:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)

        def orphaned() -> None:  # the caller died (SIGKILL): so does the run, as its own process would
            try:
                conn.recv(1)
            finally:
                os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=orphaned, daemon=True).start()
        sys.argv = ["-m", *request["argv"]]
        try:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as stop:
            if stop.code is None:
                code = 0
            elif isinstance(stop.code, int):
                code = stop.code
            else:
                print(stop.code, file=sys.stderr)
                code = 1
        except KeyboardInterrupt:
            traceback.print_exc()
            code = -signal.SIGINT
        except BaseException:
            traceback.print_exc()
            code = 1
        threading._shutdown()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        if code < 0:
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        os._exit(code & 0xFF)


# ---------------------------------------------------------------- caller


def ready(path: str, wait_s: float = 60.0) -> bool:
    """Whether the server listens at path, waiting while it starts (path.pid names it: its imports
    take ~7 s, and a run that went its own way meanwhile would pay them again)."""
    import time

    deadline = time.monotonic() + wait_s
    while not os.path.exists(path):
        try:
            with open(path + ".pid") as f:
                os.kill(int(f.read()), 0)  # still starting
        except (OSError, ValueError):
            return False  # none started, or it died
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def real_python(args: list[str]) -> None:
    python = os.environ.get("KIT_REAL_PYTHON") or sys.executable
    os.execv(python, [python, *args])


def call(args: list[str]) -> None:
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    rest = list(args)
    while rest and rest[0] == "-u":
        unbuffered = True
        rest.pop(0)
    path = os.environ.get("KIT_FORKSERVER", "")
    if len(rest) < 2 or rest[0] != "-m" or rest[1] not in MODULES or not path or not ready(path):
        real_python(args)
    try:
        with open(path + ".env") as f:
            server = json.load(f)
        if server["env"] != comparable(dict(os.environ)) or not within(limits(), server["limits"]):
            real_python(args)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(path)
    except (OSError, ValueError, KeyError):
        real_python(args)
    env = dict(os.environ)
    if rest[1] == "train":
        # the run's own subprocesses are the real interpreter's (torchrun's ranks not)
        env.pop("KIT_FORKSERVER", None)
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    ignored = [int(n) for n in IGNORABLE if signal.getsignal(n) == signal.SIG_IGN]
    request = json.dumps(
        {
            "module": rest[1],
            "argv": rest[2:],
            "env": env,
            "cwd": os.getcwd(),
            "unbuffered": unbuffered,
            "limits": limits(),
            "ignored": ignored,
        }
    )
    import array

    conn.sendmsg(
        [request.encode() + b"\n"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]))]
    )
    lines = conn.makefile("r")
    first = lines.readline()
    if not first.startswith("pid "):
        real_python(args)  # nothing ran: the server went away before forking
    pid = int(first.split()[1])
    def forward(number, _frame) -> None:
        try:
            os.kill(pid, number)
        except ProcessLookupError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    last = ""
    while not last.startswith("exit "):
        last = lines.readline()
        if not last:  # the server died: the run's status is lost
            sys.exit(1)
    status = int(last.split()[1])
    # a test measuring CPU (suite_control.CpuSpent): the run is not our child
    log = os.environ.get("KIT_CPU_LOG")
    if log and len(last.split()) > 2:
        with open(log, "a") as f:
            f.write(last.split()[2] + "\n")
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        signal.signal(number, signal.SIG_DFL)
        os.kill(os.getpid(), number)
    sys.exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve(sys.argv[2])
    else:
        call(sys.argv[1:])
