"""The rule that splits the suite (tests/conftest.py): a test that starts another process or a whole
training run, itself, through a fixture or through any helper of the tests' folder it calls, is
marked "integration"; `make test-fast` runs the rest (`pytest -m "not integration"`)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import ROOT, TESTS, is_integration

PLANTED = '''
import subprocess
from conftest import run_cli
from helpers import through_a_helper


def run_it(argv):
    return subprocess.run(argv)


def twice(argv):
    return [run_it(argv), run_it(argv)]


def test_pure():
    assert 1 + 1 == 2


def test_direct():
    subprocess.run(["true"])


def test_through_two_calls():
    twice(["true"])


def test_a_whole_run():
    run_cli("pretrain", "--max_steps", "1")


def test_imported_helper():
    through_a_helper()


def test_a_fixture(spawned):
    pass


def test_a_conftest_fixture(base_model):
    pass


def test_compiled():
    torch.compile(lambda x: x)
'''
HELPERS = '''
import os


def through_a_helper():
    os.system("true")
'''
CONFTEST = '''
import pytest
from conftest import run_cli


@pytest.fixture
def base_model():
    run_cli("pretrain")
'''


def test_the_rule_follows_calls_fixtures_and_imports(tmp_path):
    (tmp_path / "test_planted.py").write_text(
        PLANTED + "\n\n@pytest.fixture\ndef spawned():\n    twice([])\n"
    )
    (tmp_path / "helpers.py").write_text(HELPERS)
    (tmp_path / "conftest.py").write_text(CONFTEST)
    path = tmp_path / "test_planted.py"
    assert not is_integration(path, "test_pure", ["tmp_path"])
    for test in ("test_direct", "test_through_two_calls", "test_a_whole_run", "test_imported_helper"):
        assert is_integration(path, test, []), test
    assert is_integration(path, "test_a_fixture", ["spawned"]) and not is_integration(
        path, "test_a_fixture", []
    )
    assert is_integration(path, "test_a_conftest_fixture", ["base_model"])
    assert is_integration(path, "test_compiled", []) and is_integration(path, "test_pure", ["tiny_flags"])


def test_the_kits_own_tests_are_split_by_it():
    # via launch()
    assert is_integration(TESTS / "test_launchers.py", "test_baseline_defaults_are_the_guides", [])
    assert is_integration(
        TESTS / "test_knob_added.py", "test_one_field_in_config_py_is_a_knob_everywhere", []
    )
    # a module fixture over the session's pretraining run (conftest's base_model)
    assert is_integration(
        TESTS / "test_sft.py", "test_each_format_trains", ["fmt", "sft_flags", "base_model", "tmp_path"]
    )
    # the command line
    assert is_integration(TESTS / "test_knob_lists.py", "test_the_knobs_command", ["capsys"])
    assert not is_integration(TESTS / "test_knob_lists.py", "test_the_comment_rules", [])
    # MemTracker
    assert is_integration(TESTS / "test_t5_measure.py", "test_estimate_matches_a_tracked_t5_step", [])
    assert not is_integration(
        TESTS / "test_loss.py", "test_chunked_equals_plain_loss_and_gradients", ["chunk"]
    )
    assert (
        "test-fast" in (ROOT / "Makefile").read_text()
        and '-m "not integration"' in (ROOT / "Makefile").read_text()
    )


def planted_suite(tmp_path: Path) -> None:
    """A folder pytest runs as the kit's suite: the kit's conftest (and its suite_control), nothing else."""
    for name in ("conftest.py", "suite_control.py"):
        shutil.copy(TESTS / name, tmp_path / name)


def test_pytest_marks_a_planted_folder(tmp_path):
    """The hook as pytest runs it: -m picks the marked tests."""
    planted_suite(tmp_path)
    units = "".join(f"def test_unit_{i}():\n    assert True\n\n\n" for i in range(5))
    (tmp_path / "test_planted.py").write_text(f"import subprocess\n\n\n{units}def test_a_process():\n    "
                                              f"subprocess.run(['true'])\n")

    def collected(*args: str) -> set[str]:
        out = subprocess.run([sys.executable, "-m", "pytest", "--co", "-q", "-p", "no:cacheprovider", *args],
                             cwd=tmp_path, capture_output=True, text=True, timeout=120)  # fmt: skip
        assert out.returncode == 0, out.stdout + out.stderr
        return {line.split("::")[1] for line in out.stdout.splitlines() if "::" in line}

    assert collected("-m", "integration") == {"test_a_process"}
    assert collected("-m", "not integration") == {f"test_unit_{i}" for i in range(5)}


def test_make_tests_workers_run_each_module_once_on_one_worker_longest_first(tmp_path):
    """make test's pytest-xdist line (the Makefile's TEST_ARGS): every test runs exactly once, a module's
    tests all on one worker, both workers take modules; with one worker the modules run in
    module_seconds.json's order, longest first, not the files' order."""
    planted_suite(tmp_path)
    seconds = {f"test_m{m}.py": 10 * m for m in range(6)}  # test_m5 the longest
    (tmp_path / "module_seconds.json").write_text(json.dumps(seconds))
    for m in range(6):
        tests = "".join(f"def test_{m}_{i}():\n    ran('{m}_{i}')\n\n\n" for i in range(3))
        (
            tmp_path / f"test_m{m}.py"
        ).write_text(  # the first module's first test waits for the other worker's start
            "import os\nimport time\n\n\ndef ran(name):\n    deadline = time.monotonic() + 60\n"
            f"    log = {str(tmp_path / 'ran.txt')!r}\n"
            "    while name == '5_0' and os.environ.get('PYTEST_XDIST_WORKER_COUNT') == '2' and "
            "time.monotonic() < deadline:\n"
            "        if os.path.exists(log) and any(line.split()[0] != str(os.getpid()) for line in "
            "open(log)):\n            break\n"
            "        time.sleep(0.05)\n"
            "    with open(log, 'a') as f:\n"
            "        f.write(f'{os.getpid()} {name}\\n')\n\n\n" + tests
        )
    args = re.search(r"^TEST_ARGS = (.*)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    args = args.replace("$(TEST_WORKERS)", "{n}").replace("$(TESTS)", "").split()

    def run(workers: int) -> list[list[str]]:
        (tmp_path / "ran.txt").unlink(missing_ok=True)
        argv = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            *[a.format(n=workers) for a in args],
        ]
        out = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout + out.stderr
        return [line.split() for line in (tmp_path / "ran.txt").read_text().splitlines()]

    rows = run(2)
    names = [name for _, name in rows]
    assert sorted(names) == sorted(f"{m}_{i}" for m in range(6) for i in range(3))  # each once
    worker_of: dict[str, set] = {}
    for pid, name in rows:
        worker_of.setdefault(name.split("_")[0], set()).add(pid)
    assert all(len(pids) == 1 for pids in worker_of.values()), worker_of  # a module on one worker
    assert len({pid for pid, _ in rows}) == 2  # both workers took modules
    order = [name.split("_")[0] for _, name in run(1)]
    assert list(dict.fromkeys(order)) == ["5", "4", "3", "2", "1", "0"]
