"""Knob lists kept by hand beside config.py stay tied to it: the launchers' variable lists
(scripts/common.sh), the README's knob tables, the flags that take "auto", and the settings a
resume compares. A knob added to config.py and forgotten elsewhere fails here."""

from __future__ import annotations

import dataclasses
import re

import config
from conftest import ROOT
from train.config.flags import AUTO_FIELDS, training_parser
from train.run.checkpointer import COMPARED

SET_BY_THE_LAUNCHER = {"mode", "launcher"}  # the command and the script's own name, not variables
SWITCH_FIELDS = {"fp16": "precision", "bf16": "precision", "gradient_checkpointing": "gradient_checkpointing"}


def shell_list(name: str) -> list[str]:
    text = (ROOT / "scripts" / "common.sh").read_text()
    start = text.index(f"{name}=(") + len(name) + 2
    return text[start: text.index(")", start)].split()


def pairs(name: str) -> dict[str, str]:
    return dict(item.split(":--") for item in shell_list(name))


def readme_variables() -> set[str]:
    """Upper-case names in the first column of the README's knob tables."""
    found = set()
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith("| ") and line.count("|") >= 3:
            found |= set(re.findall(r"\b[A-Z][A-Z0-9_]{2,}\b", line.split("|")[1]))
    return found


def test_the_launchers_know_every_config_field_by_its_one_name():
    values, switches = pairs("KIT_VALUE_KNOBS"), pairs("KIT_SWITCH_KNOBS")
    fields = set(config.FIELD_SECTION)
    assert {f for f in values.values()} | {SWITCH_FIELDS[f] for f in switches.values()} == fields - SET_BY_THE_LAUNCHER
    assert all(config.env_name(f) == v for v, f in values.items()), "variable is not env_name(field)"
    flags = {a.dest for a in training_parser("pretrain")._actions}
    assert set(values.values()) | set(switches.values()) <= flags


def test_the_readme_tables_name_the_knobs_and_only_them():
    knobs = set(pairs("KIT_VALUE_KNOBS")) | set(pairs("KIT_SWITCH_KNOBS"))
    listed = readme_variables()
    assert knobs - listed == set(), "knobs missing from the README's tables"
    others = set(shell_list("KIT_OTHER_VARIABLES"))
    assert listed - knobs - others == set(), "README table rows that are not knobs of the kit"


def test_auto_fields_and_resume_comparisons_are_config_fields():
    defaults = {f.name: f.default for klass in config.SECTIONS.values() for f in dataclasses.fields(klass)}
    assert all(defaults[name] is None for name in AUTO_FIELDS)
    assert set(COMPARED) <= set(defaults)
