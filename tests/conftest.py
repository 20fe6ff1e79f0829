"""Shared fixtures: a deterministic small corpus, a tiny GPT-2 config, a shared token cache.

Tests never download anything and never read ../shared: the corpus is generated here.
"""

from __future__ import annotations

import ast
import functools
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
# The interpreter the launchers run and SHOW_COMMAND=1 prints (scripts/common.sh kit_python).
KIT_PY = str(ROOT / ".venv" / "bin" / "python") if (ROOT / ".venv" / "bin" / "python").exists() else "python3"

WORDS = (
    "the quick brown fox jumps over a lazy dog while seven wise kings of old sang songs about "
    "rivers mountains bread wine summer winter light darkness and every small thing under heaven"
).split()


def make_text(seed: int, n_lines: int) -> str:
    """Deterministic across Python versions (random.Random with an int seed is stable)."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        n = rng.randint(4, 14)
        lines.append(" ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + ".")
    return "\n".join(lines) + "\n"


TINY_CONFIG = {
    "model_type": "gpt2",
    "n_layer": 2,
    "n_embd": 64,
    "n_head": 2,
    "n_positions": 64,
    "vocab_size": 512,
}


def tiny_model(seed: int = 0):
    """The tiny GPT-2 of TINY_CONFIG, built in memory, without dropout (for exact comparisons)."""
    from train.models.build import build_config, build_model

    cfg = build_config("nano", None, 512, 0)
    for key in ("n_layer", "n_embd", "n_head", "n_positions"):
        setattr(cfg, key, TINY_CONFIG[key])
    cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.0
    return build_model(cfg, gradient_checkpointing=False, seed=seed)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text(make_text(0, 4000))
    return path


@pytest.fixture(scope="session")
def tiny_config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / "config.json"
    path.write_text(json.dumps(TINY_CONFIG))
    return path


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def tiny_flags(corpus, tiny_config, cache_dir, tmp_path) -> list[str]:
    """Flags for a fast real run: tiny model, small corpus, shared tokenizer cache."""
    return [
        "--model_config", str(tiny_config),
        "--data_path", str(corpus),
        "--vocab_size", "512",
        "--cache_dir", str(cache_dir),
        "--output_dir", str(tmp_path / "runs"),
        "--max_length", "64",
        "--log_every", "1",
    ]  # fmt: skip


@pytest.fixture(scope="session")
def base_model(tmp_path_factory, corpus, tiny_config, cache_dir) -> Path:
    """A tiny pretraining run's final/: what SFT starts from."""
    out = tmp_path_factory.mktemp("pretrain")
    argv = ["--model_config", str(tiny_config), "--data_path", str(corpus), "--vocab_size", "512",
            "--cache_dir", str(cache_dir), "--output_dir", str(out), "--max_length", "64",
            "--batch_size", "4", "--max_steps", "2", "--run_name", "base"]  # fmt: skip
    assert run_cli("pretrain", *argv) == 0
    return out / "base" / "final"


def run_cli(*argv: str) -> int:
    """Run `python -m train ...` in this process (fast: torch is imported once)."""
    from train.__main__ import run

    old = sys.argv
    sys.argv = ["train", *argv]
    try:
        return run()
    finally:
        sys.argv = old


CLEAN_ENV = ("PATH", "HOME", "LANG", "TMPDIR")  # what a launcher test's environment starts from
_FORKSERVER: dict = {}


def _reach(root: Path) -> dict:
    """Where the server for the kit at root listens, once per pytest process: {"folder", "python":
    its caller, "env": what a process needs to reach it, "server": its process once fork_server
    started it, else None}. Nothing is started here; the folder goes when pytest exits."""
    import shlex
    import stat
    import tempfile

    key = str(root)
    if key not in _FORKSERVER:
        import atexit
        import shutil

        folder = Path(tempfile.mkdtemp(prefix="kit-forkserver-"))
        # after the server's kill (atexit runs last first)
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        reach = {
            "KIT_FORKSERVER": str(folder / "s"),
            "KIT_FORKSERVER_ROOT": key,
            "KIT_REAL_PYTHON": sys.executable,
        }
        caller = folder / "python"
        script = shlex.join([sys.executable, "-S", str(ROOT / "tests" / "forkserver.py")])
        caller.write_text(f"#!/bin/sh\nexec {script} \"$@\"\n")
        caller.chmod(caller.stat().st_mode | stat.S_IXUSR)
        _FORKSERVER[key] = {"folder": folder, "python": str(caller), "env": reach, "server": None}
    return _FORKSERVER[key]


def fork_server(root: Path = ROOT) -> dict:
    """A warm server (tests/forkserver.py) for the kit at root, started once per pytest process:
    {"python": its caller, "env": what a process needs to reach it}. A kit copy gets its own,
    which imports the copy's code (config.py finds its runs/ beside itself)."""
    import os

    server = _reach(root)
    if server["server"] is None:
        import atexit

        folder, key = server["folder"], str(root)
        env = {**{k: v for k, v in os.environ.items() if k in CLEAN_ENV}, "PYTHONPATH": key, **server["env"]}
        log = open(folder / "server.log", "w")  # noqa: SIM115 (the server's, closed with it)
        server["server"] = subprocess.Popen([sys.executable, str(ROOT / "tests" / "forkserver.py"), "serve",
                                             server["env"]["KIT_FORKSERVER"]], cwd=root, env=env,
                                            stdin=subprocess.DEVNULL, stdout=log, stderr=log)  # fmt: skip
        # callers wait for its socket while it starts
        (folder / "s.pid").write_text(str(server["server"].pid))
        atexit.register(server["server"].kill)
    return server


def forking() -> bool:
    """Whether tests run the kit as forks of a warm server (KIT_TEST_FORKSERVER=0: every run a fresh
    interpreter)."""
    import os

    return os.environ.get("KIT_TEST_FORKSERVER") != "0"


def train_python() -> str:
    """The interpreter for a test's own `python -m train` process: tests/forkserver.py's caller,
    which runs it as a fork of a warm server (the imports paid once per pytest process) where the
    environment allows, else becomes the real interpreter. Not for tests that read the run's
    process tree: the run is not the caller's child."""
    return fork_server()["python"] if forking() else sys.executable


if forking():  # this process's children reach the server, even with an environment copied before it started
    import os as _os

    _os.environ.update(_reach(ROOT)["env"])


def launcher_env(env: dict) -> dict:
    """A clean environment (CLEAN_ENV) with `env` added, for running a launcher as a user would.
    Its `python -m train` runs through train_python() (KIT_PYTHON) unless SHOW_COMMAND asks for
    the command itself or the test names its own KIT_PYTHON."""
    import os

    base = {k: v for k, v in os.environ.items() if k in CLEAN_ENV}
    if "SHOW_COMMAND" not in env and "KIT_PYTHON" not in env and forking():
        base["KIT_PYTHON"] = train_python()
        base.update(fork_server()["env"])
    return {**base, **env}


def launch(script: str, env: dict, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run a launcher as a user would, with only the given variables added to a clean env."""
    base = launcher_env(env)
    return subprocess.run(
        ["bash", str(ROOT / script), *args],
        env=base,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---- the fast layer: `make test-fast` runs the tests not marked "integration" -----------------
# A test is "integration" when its code starts another process or a whole run, or drives torch's
# whole-program machinery: its body, the fixtures it uses and every function of the tests' folder
# they call (followed through this file and the test modules they import) name one of STARTERS.
# The rest are unit tests: functions and tiny models called in this process, seconds each.
# tests/test_fast_layer.py plants each kind and checks.
STARTERS = frozenset({
    # processes
    "subprocess", "Popen", "system", "start_processes", "ProcessPoolExecutor", "multiprocessing",
    # whole runs: the command line and the tools' entry points in this process, the flags of a
    # real run (tiny_flags), a pretraining run's model (base_model)
    "run_cli", "main", "tiny_flags", "base_model",
    # torch.compile (dynamo traces), torch.profiler, MemTracker: a whole step traced, many seconds
    "compile", "profile", "MemTracker",
})  # fmt: skip
TESTS = Path(__file__).resolve().parent


@functools.cache
def _names_of(path: Path) -> tuple[dict[str, frozenset], dict[str, Path]]:
    """({function: the names its body uses}, {name imported from a module of the tests' folder: that
    file})."""
    tree = ast.parse(path.read_text())
    defs, imported = {}, {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
            used |= {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
            defs[node.name] = frozenset(used | defs.get(node.name, frozenset()))
        elif (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and (path.parent / f"{node.module}.py").exists()
        ):
            imported.update({a.asname or a.name: path.parent / f"{node.module}.py" for a in node.names})
    return defs, imported


def starts_processes(path: Path, name: str, seen: set | None = None) -> bool:
    """Does function `name` of the file at path start a process or a run, itself or through a call?"""
    seen = set() if seen is None else seen
    if (path, name) in seen:
        return False
    seen.add((path, name))
    defs, imported = _names_of(path)
    if name not in defs:
        return name in imported and starts_processes(imported[name], name, seen)
    used = defs[name]
    if used & STARTERS:
        return True
    return any(starts_processes(path, n, seen) for n in used if n in defs or n in imported)


def is_integration(path: Path, test: str, fixtures: list[str]) -> bool:
    conftest = path.parent / "conftest.py"
    return starts_processes(path, test) or any(
        f in STARTERS or starts_processes(path, f) or (conftest.exists() and starts_processes(conftest, f))
        for f in fixtures
    )


@pytest.hookimpl(tryfirst=True)  # before -m "not integration" reads the marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        test = getattr(item, "originalname", None) or item.name.split("[")[0]
        if is_integration(Path(str(item.fspath)), test, list(getattr(item, "fixturenames", ()))):
            item.add_marker(pytest.mark.integration)


# Seconds each module took in a whole run of the suite on the 2-core host, for the workers' order: the
# larger of its wall time (under the other worker's load) and its CPU time (its own process, its
# children and the fork server's children), summed over its tests. A module not listed weighs 3 s a test.
_SECONDS = Path(__file__).parent / "module_seconds.json"
MODULE_SECONDS = json.loads(_SECONDS.read_text()) if _SECONDS.is_file() else {}


def module_weight(path: str, tests: int) -> int:
    """A module's seconds for the workers' order: MODULE_SECONDS's, or 3 s a test where it is not listed."""
    return MODULE_SECONDS.get(Path(path).name, 3 * tests)


# ---- make test: pytest-xdist's workers, the longest modules first ---------------------------------
# `make test` runs `pytest -n 2 --dist loadfile --no-loadscope-reorder`: xdist keeps a module's tests
# on one worker (its module fixtures, a whole reference run, made once) and hands each worker the
# next module as it frees, in the order the workers collected them: this hook's, longest first, so
# the last module to start is a short one and the two workers end close together.


class LongestFirst:
    """In each xdist worker: the modules in the order of their MODULE_SECONDS, longest first."""

    @pytest.hookimpl(trylast=True)  # after -m has deselected
    def pytest_collection_modifyitems(self, config, items):
        modules: dict[str, list] = {}
        for item in items:
            modules.setdefault(str(item.fspath), []).append(item)
        order = sorted(modules, key=lambda path: (-module_weight(path, len(modules[path])), path))
        items[:] = [item for path in order for item in modules[path]]


def pytest_configure(config):
    """An xdist worker orders its modules longest first (a plain pytest run keeps the files' order). In
    the xdist controller (it runs no test), Ctrl-C and SIGTERM stop every process of the suite
    (tests/suite_control.py); in a plain pytest run, SIGTERM does."""
    import threading

    import suite_control

    if hasattr(config, "workerinput"):
        config.pluginmanager.register(LongestFirst(), "longest-first")
    elif threading.current_thread() is threading.main_thread():
        suite_control.install(controller=bool(getattr(config.option, "numprocesses", None)))
