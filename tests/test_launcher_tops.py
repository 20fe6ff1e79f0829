"""Every knob a user sets sits at the top of each launcher (issue 28, item 5): the set is derived
from config.py (its fields and markers) and from the mode the launcher itself runs (`kit_launch
MODE PRESET`), so a knob added there and missing here fails this test, and a new launcher is
checked as soon as it exists."""

from __future__ import annotations

import re

import pytest

import config
from conftest import ROOT
from train.config import knob_docs, knobs

LAUNCHERS = knob_docs.launchers()
# Launcher variables that are no config field: the guides' precision switches and torchrun's count.
NOT_FIELDS = tuple(variable for variable, *_ in knob_docs.LAUNCHER_ONLY)
KNOB_LINE = re.compile(r"^([A-Z][A-Z0-9_]*)=\$\{\1:-[^}]*\}\s*(#\s*\S.*)?$")


def expected(mode: str) -> set[str]:
    """The launcher variables of every config field a user sets in this mode: every field but the
    command's own whose knob(modes=...) names this mode."""
    names = [n for n in config.FIELD_SECTION if n not in knobs.marked("command")]
    return {knobs.env_name(n) for n in names if mode in knobs.modes(n)} | set(NOT_FIELDS)


def top(text: str) -> dict[str, str]:
    """{VARIABLE: its comment} of the knob lines above `source .../common.sh`, in groups."""
    head = re.split(r"^source ", text, maxsplit=1, flags=re.M)[0]
    found, group = {}, None
    for line in head.splitlines():
        if line.startswith("# ---- "):
            group = line
        match = KNOB_LINE.match(line)
        if match and group is not None:
            found[match.group(1)] = match.group(2) or ""
    return found


def missing(text: str, mode: str) -> set[str]:
    return expected(mode) - set(top(text))


@pytest.mark.parametrize("launcher", LAUNCHERS, ids=[lw.path.name for lw in LAUNCHERS])
def test_every_knob_of_config_py_is_at_the_top(launcher):
    text = launcher.path.read_text()
    assert missing(text, launcher.mode) == set(), f"{launcher.path.name}: run `make knobs`"
    lines = top(text)
    assert [name for name, comment in lines.items() if not comment] == []  # every knob says what it does
    assert set(lines) == expected(launcher.mode)  # and no knob of another mode (it would be refused)
    # the launcher's style: set -euo pipefail, a usage line, "$@" passed last
    assert "set -euo pipefail" in text and re.search(
        r"^# Usage: .*" + re.escape(launcher.path.name), text, re.M
    )
    assert re.search(r'^kit_launch \S+ \S+ "\$@"$', text, re.M)


def test_a_knob_missing_at_the_top_is_named():
    text = (ROOT / "run_single_gpu.sh").read_text()
    without = re.sub(r"^PIN_MEMORY=.*\n", "", text, flags=re.M)
    assert missing(without, "pretrain") == {"PIN_MEMORY"}
    ungrouped = text.replace("# ---- ", "# ")  # lines outside the groups do not count
    assert "MODEL_SIZE" in missing(ungrouped, "pretrain")
    assert "PACKING" in expected("sft") and "PACKING" not in expected("pretrain")
    # dpo trains MODEL_PATH's model
    assert "MODEL_SIZE" in expected("sft") and "MODEL_SIZE" not in expected("dpo")
    assert {knobs.env_name(n) for n in config.FIELD_SECTION if "pretrain" not in knobs.modes(n)} & expected(
        "pretrain") == set()
    assert {"TEXT_FIELD", "TOKENIZER_SAMPLE_MB", "MODEL_FAMILY"} & expected("dpo") == set()
