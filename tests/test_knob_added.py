"""A new knob is one field with its doc in config.py, then `make knobs`: in a copy of the kit whose
config.py alone gains two fields, the launchers pass them, the flags parse and document them, the
run saves them in config.json, RESUME=1 names the one marked "compared" when it changed, and
pretraining refuses the one only SFT reads (knob(modes={"sft"})), with no other file of the copy edited;
the generator then writes their rows in docs/knobs.md and their lines at the top of the launchers of
their modes, and a new mode is its name added to the knobs it reads: its launcher gets its block by
the same rules."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import ROOT, fork_server, forking

NEW_FIELDS = '''    dummy_knob: int = knob(3, "compared")
    """A knob the test adds: a whole number that a resume compares."""
    dummy_sft: bool = knob(False, modes={"sft"})
    """A knob the test adds: SFT only."""

'''
SKIP = (".git", ".venv", "runs", ".cache", "tests", "bench", "__pycache__", ".ruff_cache", ".pytest_cache")


def kit_with_new_knobs(tmp_path: Path) -> Path:
    kit = tmp_path / "kit"
    shutil.copytree(ROOT, kit, ignore=shutil.ignore_patterns(*SKIP), symlinks=True)
    if (ROOT / ".venv").exists():
        (kit / ".venv").symlink_to(ROOT / ".venv")  # the launchers' own interpreter, as in a checkout
    text = (kit / "config.py").read_text()
    data = text.index("class DataConfig")
    at = text.index("    def __post_init__(self):", data)  # DataConfig's last field ends here
    (kit / "config.py").write_text(text[:at] + NEW_FIELDS + text[at:])
    return kit


def generate(kit: Path, *args: str) -> subprocess.CompletedProcess:
    """`python -m train knobs ...` in the copy (config.py, the launchers and docs of the copy)."""
    return subprocess.run(
        [sys.executable, "-m", "train", "knobs", *args],
        cwd=kit,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(kit)},
    )


def digests(kit: Path) -> dict[str, str]:
    return {
        str(p.relative_to(kit)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(kit.rglob("*"))
        if p.is_file() and not p.is_symlink() and "__pycache__" not in p.parts and ".venv" not in p.parts
    }


def launch(kit: Path, script: str, env: dict) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR")}
    return subprocess.run(
        ["bash", str(kit / script)], env={**base, **env}, capture_output=True, text=True, cwd=kit, timeout=300
    )


def test_one_field_in_config_py_is_a_knob_everywhere(tmp_path, corpus, tiny_config, cache_dir):
    kit = kit_with_new_knobs(tmp_path)
    before = digests(kit)
    original = {
        name: hashlib.sha256((ROOT / name).read_bytes()).hexdigest()
        for name in before
        if (ROOT / name).is_file()
    }
    assert {name for name in before if before[name] != original.get(name)} == {"config.py"}

    # the launchers: a variable of the kit (no misspelling warning), its flag where its mode reads it
    shown = launch(kit, "run_single_gpu.sh", {"DUMMY_KNOB": "7", "SHOW_COMMAND": "1"})
    assert shown.returncode == 0 and shown.stderr == "", shown.stderr
    assert shlex.split(shown.stdout)[shlex.split(shown.stdout).index("--dummy_knob") + 1] == "7"
    shown = launch(kit, "train_sft_custom.sh", {"DUMMY_KNOB": "7", "DUMMY_SFT": "1", "SHOW_COMMAND": "1"})
    assert shown.returncode == 0 and shown.stderr == "", shown.stderr
    argv = shlex.split(shown.stdout)
    assert argv[argv.index("--dummy_knob") + 1] == "7" and argv[argv.index("--dummy_sft") + 1] == "1"
    refused = launch(kit, "run_single_gpu.sh", {"DUMMY_SFT": "1", "SHOW_COMMAND": "1"})
    assert refused.returncode == 2 and refused.stdout == "" and refused.stderr == (
        "error: DUMMY_SFT does not apply to pretraining (run_single_gpu.sh): it is read by SFT only; "
        "leave it empty\n")

    # the flags: typed, documented, a bad value named by its variable, the SFT-only one refused
    probe = """
import sys
from train.config.flags import parse_training_args, training_parser
from train.core.errors import UsageError
print(parse_training_args("pretrain", ["--dummy_knob", "5"]).data.dummy_knob + 1)
print("[DUMMY_KNOB] A knob the test adds" in training_parser("pretrain").format_help())
for argv in (["--dummy_knob", "abc"], ["--dummy_sft", "1"]):
    try:
        parse_training_args("pretrain", argv)
    except UsageError as err:
        print(err)
"""
    out = subprocess.run([sys.executable, "-c", probe], cwd=kit, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(kit)})  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == [
        "6",
        "True",
        "DUMMY_KNOB (--dummy_knob): expected a whole number, got 'abc'",
        "DUMMY_SFT (--dummy_sft) does not apply to pretraining (`python -m train pretrain`): it is read "
        "by SFT only; leave it empty",
    ]

    # a real run saves it; RESUME=1 says it changed
    env = {
        "MODEL_CONFIG": str(tiny_config),
        "DATA_PATH": str(corpus),
        "VOCAB_SIZE": "512",
        "CACHE_DIR": str(cache_dir),
        "OUTPUT_DIR": str(tmp_path / "runs"),
        "RUN_NAME": "dummy",
        "MAX_LENGTH": "64",
        "BATCH_SIZE": "4",
        "MAX_STEPS": "2",
        "EVAL_BATCHES": "1",
        "DUMMY_KNOB": "7",
    }
    if forking():  # the runs forks of a warm server that imported this copy (its config.py as edited above)
        server = fork_server(kit)
        env.update(KIT_PYTHON=server["python"], **server["env"])
    first = launch(kit, "run_single_gpu.sh", env)
    assert first.returncode == 0, first.stderr[-2000:]
    saved = json.loads((tmp_path / "runs" / "dummy" / "config.json").read_text())
    assert saved["config"]["data"]["dummy_knob"] == 7
    again = launch(kit, "run_single_gpu.sh", {**env, "RESUME": "1", "MAX_STEPS": "3", "DUMMY_KNOB": "9"})
    assert again.returncode == 0, again.stderr[-2000:]
    log = (tmp_path / "runs" / "dummy" / "train.log").read_text()
    assert "changed since the checkpoint: " in log and "DUMMY_KNOB 7 -> 9" in log

    assert digests(kit) == before  # the runs wrote outside the kit

    # an edit that breaks config.py: one line naming it, exit code 2, from any launcher
    (kit / "config.py").write_text((kit / "config.py").read_text().replace('knob(3, "compared")', "knob(3, "))
    broken = launch(kit, "train_sft_custom.sh", {"SHOW_COMMAND": "1"})
    assert broken.returncode == 2 and broken.stdout == ""
    assert (
        broken.stderr.startswith("error: config.py cannot be read: SyntaxError")
        and broken.stderr.count("\n") == 1
    )


NEW_LAUNCHER = """#!/usr/bin/env bash
# A new mode's launcher as it arrives: no knob lines yet.
# Usage: [VAR=value ...] ./train_ppo.sh [--any_flag value ...]
set -euo pipefail

source "$(dirname "$0")/scripts/common.sh"
kit_launch ppo sft "$@"
"""


def block_of(path: Path) -> dict[str, str]:
    """{VARIABLE: its line} between the launcher's BEGIN and END lines."""
    lines = path.read_text().splitlines()
    begin = next(i for i, line in enumerate(lines) if line.startswith("# BEGIN knobs"))
    end = lines.index("# END knobs", begin)
    return {line.split("=")[0]: line for line in lines[begin:end] if re.match(r"^[A-Z][A-Z0-9_]*=\$\{", line)}


def test_the_generator_writes_a_new_field_into_the_docs_and_the_launchers_of_its_mode(tmp_path):
    kit = kit_with_new_knobs(tmp_path)
    before = digests(kit)
    stale = generate(kit, "--check")
    assert stale.returncode == 1 and "out of date (make knobs): docs/knobs.md" in stale.stdout
    written = generate(kit, "--write")
    assert written.returncode == 0, written.stderr
    after = digests(kit)
    changed = {name for name in after if after[name] != before.get(name)}
    launchers = {
        "run_single_gpu.sh",
        "run_single_gpu_optimized.sh",
        "train_sft_custom.sh",
        "quick_start_sft_fast.sh",
        "train_dpo.sh",
        "train_grpo.sh",
    }
    assert changed == {"docs/knobs.md"} | launchers
    assert all(os.access(kit / name, os.X_OK) for name in launchers)  # still executable
    assert generate(kit, "--check").stdout.strip() == "knob docs up to date"

    doc = (kit / "docs" / "knobs.md").read_text()
    every, sft = doc.split("\n## Every mode\n")[1].split("\n## SFT\n")
    assert "| DUMMY_KNOB | --dummy_knob | a whole number |" in every and ("A knob the test adds: a whole "
                                                                          "number") in every
    assert "| DUMMY_SFT | --dummy_sft |" in sft.split("<!-- END knobs")[0] and "DUMMY_SFT" not in every
    for name in launchers:
        block = block_of(kit / name)
        assert block["DUMMY_KNOB"].endswith("# a knob the test adds: a whole number that a resume compares; "
                                            "empty: 3")
        assert ("DUMMY_SFT" in block) == name.startswith(("train_sft", "quick_start_sft"))
    # the launchers' own defaults and lines outside the block are kept
    assert block_of(kit / "quick_start_sft_fast.sh")["GRADIENT_ACCUM"].startswith(
        "GRADIENT_ACCUM=${GRADIENT_ACCUM:-2} "
    )
    assert "effective batch = BATCH_SIZE" in (kit / "quick_start_sft_fast.sh").read_text()


def test_a_new_mode_and_its_launcher_get_their_block_by_the_rules(tmp_path):
    kit = kit_with_new_knobs(tmp_path)
    # what a new mode brings: its name among the modes and in the knobs it reads (here the group of every
    # mode's and a field of its own), and a launcher; no other file
    cfg = (kit / "config.py").read_text()
    for old, new in (('MODES = ("pretrain", "sft", "dpo", "grpo")',
                      'MODES = ("pretrain", "sft", "dpo", "grpo", "ppo")'),
                     ('EVERY, FINE_TUNING, FROM_SCRATCH = {"pretrain", "sft", "dpo", "grpo"}',
                      'EVERY, FINE_TUNING, FROM_SCRATCH = {"pretrain", "sft", "dpo", "grpo", "ppo"}'),
                     ('knob(False, modes={"sft"})', 'knob(False, modes={"ppo"})')):
        assert cfg.count(old) == 1, old
        cfg = cfg.replace(old, new)
    assert cfg.count('"ppo"') == 3
    (kit / "config.py").write_text(cfg)
    (kit / "train_ppo.sh").write_text(NEW_LAUNCHER)
    (kit / "train_ppo.sh").chmod(0o755)
    shown = generate(kit, "--launcher", "train_ppo.sh")
    assert shown.returncode == 0, shown.stderr
    written = generate(kit, "--write")
    assert written.returncode == 0 and "train_ppo.sh" in written.stdout, written.stderr
    ppo = block_of(kit / "train_ppo.sh")
    assert (
        "\n".join(["# BEGIN knobs" + shown.stdout.split("# BEGIN knobs", 1)[1].rstrip()])
        in (kit / "train_ppo.sh").read_text()
    )
    assert "DUMMY_SFT" in ppo and "DUMMY_KNOB" in ppo and "SEED" in ppo and "NPROC_PER_NODE" in ppo
    assert not {"MODEL_SIZE", "MODEL_PATH", "PACKING", "BETA"} & set(ppo)  # their modes do not name it
    assert "DUMMY_SFT" not in block_of(kit / "train_sft_custom.sh") and "DUMMY_SFT" not in block_of(
        kit / "run_single_gpu.sh"
    )
    text = (kit / "train_ppo.sh").read_text()
    assert text.index("set -euo pipefail") < text.index("# BEGIN knobs") < text.index(
        "source "
    ) and text.endswith('"$@"\n')
    doc = (kit / "docs" / "knobs.md").read_text()
    assert "\n\nRead by `python -m train ppo` only (launchers: `train_ppo.sh`); the other modes" in doc
    # the launcher passes its knobs as flags (scripts/common.sh reads the same fields)
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR")}
    out = subprocess.run(
        ["bash", str(kit / "train_ppo.sh")],
        env={**env, "SHOW_COMMAND": "1", "DUMMY_SFT": "1"},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=kit,
    )
    assert out.returncode == 0 and out.stderr == "", out.stderr
    argv = shlex.split(out.stdout)
    assert argv[argv.index("-m") + 1 : argv.index("-m") + 3] == ["train", "ppo"] and "--dummy_sft" in argv
    refused = subprocess.run(["bash", str(kit / "train_ppo.sh")], cwd=kit, capture_output=True, text=True,
                             env={**env, "SHOW_COMMAND": "1", "BETA": "0.2"}, timeout=120)
    assert refused.returncode == 2 and refused.stderr.startswith(
        "error: BETA does not apply to `python -m train ppo` (train_ppo.sh): it is read by preference "
        "training and reward training only")
