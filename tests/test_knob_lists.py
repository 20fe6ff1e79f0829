"""The knob lists are derived from config.py's fields and their markers (knob(default, "auto",
"sft", "compared", ...)): the launchers' variable lists (scripts/common.sh asks Python once per
start), the flags that take "auto", the SFT-only refusals and the settings a resume compares.
The knob tables of docs/knobs.md (the README links them) are written by hand, so they are checked
against config.py here."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess

import pytest

import config
from conftest import ROOT
from train.config import knobs
from train.config.flags import AUTO_FIELDS, training_parser
from train.core.checks import knob
from train.run.checkpoint.checkpointer import COMPARED
from train.run.plan.sft import DPO_ONLY, SFT_ONLY

FIELDS = {f.name: f for klass in config.SECTIONS.values() for f in dataclasses.fields(klass)}


def shell_lists() -> dict[str, list[str]]:
    """The arrays scripts/common.sh holds once sourced (as the launchers see them)."""
    script = 'source scripts/common.sh; for a in KIT_VALUE_KNOBS KIT_SWITCH_KNOBS KIT_OTHER_VARIABLES; do ' \
             'declare -n list=$a; echo "$a ${list[*]}"; done'  # fmt: skip
    env = {"KIT_NAMES_CHECKED": "1", "PATH": os.environ["PATH"]}
    out = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, check=True, env=env)
    return {line.split()[0]: line.split()[1:] for line in out.stdout.splitlines()}


def pairs(items: list[str]) -> dict[str, str]:
    return dict(item.split(":--") for item in items)


KNOB_TABLES = ROOT / "docs" / "knobs.md"


def readme_variables() -> set[str]:
    """Upper-case names in the first column of the knob tables (docs/knobs.md)."""
    found = set()
    for line in KNOB_TABLES.read_text().splitlines():
        if line.startswith("| ") and line.count("|") >= 3:
            found |= set(re.findall(r"\b[A-Z][A-Z0-9_]{2,}\b", line.split("|")[1]))
    return found


def test_the_launchers_know_every_config_field_by_its_one_name():
    lists = shell_lists()
    values, switches = pairs(lists["KIT_VALUE_KNOBS"]), pairs(lists["KIT_SWITCH_KNOBS"])
    assert [f"{v}:--{f}" for v, f in values.items()] == knobs.launcher_lists()[0]
    command = set(knobs.marked("command"))
    assert command == {"mode", "launcher"}  # the command and the script's own name, not variables
    switch_fields = set(switches.values()) - {"fp16", "bf16"}  # the precision shorthands
    assert set(values.values()) | switch_fields == set(FIELDS) - command
    assert not set(values.values()) & switch_fields
    assert all(config.env_name(f) == v for v, f in {**values, **switches}.items() if f in FIELDS)
    # the guides' names (DESIGN's table) where a variable is not the field in upper case
    assert values["GRADIENT_ACCUM"] == "gradient_accumulation_steps"
    assert switches == {"ENABLE_FP16": "fp16", "ENABLE_BF16": "bf16", "ENABLE_GRAD_CKPT": "gradient_checkpointing"}
    flags = {a.dest for a in training_parser("pretrain")._actions}
    assert set(values.values()) | set(switches.values()) <= flags


def test_the_readme_tables_name_every_knob_and_only_them():
    lists = shell_lists()
    knob_variables = {config.env_name(f) for f in FIELDS if f not in knobs.marked("command")} | {"ENABLE_FP16", "ENABLE_BF16"}
    listed = readme_variables()
    assert knob_variables - listed == set(), "knobs of config.py without a row in docs/knobs.md's tables"
    assert listed - knob_variables - set(lists["KIT_OTHER_VARIABLES"]) == set(), "docs/knobs.md rows that are no knob of the kit"
    assert "(docs/knobs.md)" in (ROOT / "README.md").read_text()  # the README leads to them


def test_markers_pick_the_lists_and_their_fields_fit_them():
    assert set(AUTO_FIELDS) == {"max_length", "warmup_steps", "model_size", "log_every", "reference"}
    assert all(FIELDS[name].default is None for name in AUTO_FIELDS)  # empty / auto / none: the run decides
    assert set(SFT_ONLY) == {"model_path", "trust_remote_code", "length_grouping", "token_budget", "packing", "skip_bad_records",
                             "template", "loss_on", "truncation", "reasoning", "lora_r", "lora_alpha", "lora_dropout",
                             "lora_targets"}
    assert all(FIELDS[name].default in (None, False) for name in SFT_ONLY)  # "set" means not the default
    assert set(DPO_ONLY) == {"dpo_loss", "beta", "label_smoothing", "simpo_gamma", "sft_weight", "reference"}
    assert all(FIELDS[name].default is None for name in DPO_ONLY)  # "set" means not empty
    assert set(COMPARED) == set(
        "batch_size gradient_accumulation_steps precision learning_rate min_lr_ratio max_steps epochs "
        "max_samples warmup_steps num_workers optimizer lr_schedule freeze lora_r lora_alpha lora_dropout lora_targets "
        "dpo_loss beta reference".split()
    )
    assert all(FIELDS[name].type == "bool" for name in knobs.marked("switch"))


def test_a_misspelled_marker_stops_at_import():
    with pytest.raises(ValueError, match="unknown knob marker"):
        knob(None, "compare")
