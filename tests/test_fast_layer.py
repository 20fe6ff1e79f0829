"""The rule that splits the suite (tests/conftest.py): a test that starts another process or a whole
training run, itself, through a fixture or through any helper of the tests' folder it calls, is
marked "integration"; `make test-fast` runs the rest (`pytest -m "not integration"`)."""

from __future__ import annotations

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
    (tmp_path / "test_planted.py").write_text(PLANTED + "\n\n@pytest.fixture\ndef spawned():\n    twice([])\n")
    (tmp_path / "helpers.py").write_text(HELPERS)
    (tmp_path / "conftest.py").write_text(CONFTEST)
    path = tmp_path / "test_planted.py"
    assert not is_integration(path, "test_pure", ["tmp_path"])
    for test in ("test_direct", "test_through_two_calls", "test_a_whole_run", "test_imported_helper"):
        assert is_integration(path, test, []), test
    assert is_integration(path, "test_a_fixture", ["spawned"]) and not is_integration(path, "test_a_fixture", [])
    assert is_integration(path, "test_a_conftest_fixture", ["base_model"])
    assert is_integration(path, "test_compiled", []) and is_integration(path, "test_pure", ["tiny_flags"])


def test_the_kits_own_tests_are_split_by_it():
    assert is_integration(TESTS / "test_launchers.py", "test_baseline_defaults_are_the_guides", [])  # via launch()
    assert is_integration(TESTS / "test_knob_added.py", "test_one_field_in_config_py_is_a_knob_everywhere", [])
    # a module fixture over the session's pretraining run (conftest's base_model)
    assert is_integration(TESTS / "test_sft.py", "test_each_format_trains", ["fmt", "sft_flags", "base_model", "tmp_path"])
    assert is_integration(TESTS / "test_knob_lists.py", "test_the_knobs_command", ["capsys"])  # the command line
    assert not is_integration(TESTS / "test_knob_lists.py", "test_the_comment_rules", [])
    assert is_integration(TESTS / "test_t5_measure.py", "test_estimate_matches_a_tracked_t5_step", [])  # MemTracker
    assert not is_integration(TESTS / "test_loss.py", "test_chunked_equals_plain_loss_and_gradients", ["chunk"])
    assert "test-fast" in (ROOT / "Makefile").read_text() and '-m "not integration"' in (ROOT / "Makefile").read_text()


def test_pytest_marks_and_shards_a_planted_folder(tmp_path):
    """The hook as pytest runs it: -m picks the marked tests, and the two shards of make test-fast
    split the unit tests between them, each test in exactly one."""
    import shutil
    import subprocess
    import sys

    shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")
    units = "".join(f"def test_unit_{i}():\n    assert True\n\n\n" for i in range(5))
    (tmp_path / "test_planted.py").write_text(f"import subprocess\n\n\n{units}def test_a_process():\n    subprocess.run(['true'])\n")

    def collected(*args: str) -> set[str]:
        out = subprocess.run([sys.executable, "-m", "pytest", "--co", "-q", "-p", "no:cacheprovider", *args],
                             cwd=tmp_path, capture_output=True, text=True, timeout=120)  # fmt: skip
        assert out.returncode == 0, out.stdout + out.stderr
        return {line.split("::")[1] for line in out.stdout.splitlines() if "::" in line}

    assert collected("-m", "integration") == {"test_a_process"}
    one, two = collected("-m", "not integration", "--shard", "1/2"), collected("-m", "not integration", "--shard", "2/2")
    assert one | two == {f"test_unit_{i}" for i in range(5)} and not one & two and len(one) == 3


def test_two_shards_share_a_queue_each_module_run_once_in_one_shard(tmp_path):
    """make test's shards (--shard K/2 --queue=DIR) at once: every test runs exactly once, a
    module's tests all in one shard, and both shards take modules."""
    import shutil
    import subprocess
    import sys

    shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")
    for m in range(6):
        tests = "".join(f"def test_{m}_{i}():\n    ran('{m}_{i}')\n\n\n" for i in range(3))
        (tmp_path / f"test_m{m}.py").write_text(  # the first module's first test waits for the other shard's claim
            "import os\nimport time\n\n\ndef ran(name):\n    deadline = time.monotonic() + 60\n"
            f"    while name == '0_0' and len(os.listdir({str(tmp_path / 'queue')!r})) < 2 and time.monotonic() < deadline:\n"
            "        time.sleep(0.05)\n"
            f"    with open({str(tmp_path / 'ran.txt')!r}, 'a') as f:\n"
            "        f.write(f'{os.getpid()} {name}\\n')\n\n\n" + tests
        )
    (tmp_path / "queue").mkdir()
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--queue={tmp_path / 'queue'}"]
    shards = [subprocess.Popen([*argv, "--shard", f"{k}/2"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True) for k in (1, 2)]  # fmt: skip
    for shard in shards:
        out, _ = shard.communicate(timeout=120)
        assert shard.returncode == 0, out
    rows = [line.split() for line in (tmp_path / "ran.txt").read_text().splitlines()]
    names = [name for _, name in rows]
    assert sorted(names) == sorted(f"{m}_{i}" for m in range(6) for i in range(3))  # each once
    shard_of = {name.split("_")[0]: set() for name in names}
    for pid, name in rows:
        shard_of[name.split("_")[0]].add(pid)
    assert all(len(pids) == 1 for pids in shard_of.values()), shard_of  # a module in one shard
    assert len({pid for pid, _ in rows}) == 2  # both shards took modules
