"""The knob lists are derived from config.py's fields and their markers (knob(default, "auto",
"sft", "compared", ...)): the launchers' variable lists (scripts/common.sh asks Python once per
start), the flags that take "auto", the SFT-only refusals and the settings a resume compares. The
knob tables of docs/knobs.md and the block of knob lines at the top of every launcher are generated
from the same fields (`make knobs`), so here the committed text must be the generated text, and the
rules that pick a knob's launchers are checked against the fields, not against a list kept here."""

from __future__ import annotations

import dataclasses
import os
import subprocess

import pytest

import config
from conftest import ROOT
from train.config import knob_docs, knobs
from train.config.flags import AUTO_FIELDS, parse_value, training_parser
from train.core.checks import MARKS, knob
from train.core.errors import UsageError
from train.run.checkpoint.checkpointer import COMPARED
from train.run.plan.sft import SFT_ONLY, refuse_sft_settings

FIELDS = {f.name: f for klass in config.SECTIONS.values() for f in dataclasses.fields(klass)}
LAUNCHERS = knob_docs.launchers()


def shell_lists() -> dict[str, list[str]]:
    """The arrays scripts/common.sh holds once sourced (as the launchers see them)."""
    script = 'source scripts/common.sh; for a in KIT_VALUE_KNOBS KIT_SWITCH_KNOBS KIT_OTHER_VARIABLES; do ' \
             'declare -n list=$a; echo "$a ${list[*]}"; done'  # fmt: skip
    env = {"KIT_NAMES_CHECKED": "1", "PATH": os.environ["PATH"]}
    out = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, check=True, env=env)
    return {line.split()[0]: line.split()[1:] for line in out.stdout.splitlines()}


def pairs(items: list[str]) -> dict[str, str]:
    return dict(item.split(":--") for item in items)


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
    # the launcher-only variables the generated blocks add are the kit's own (no misspelling warning)
    launcher_only = {variable for variable, *_ in knob_docs.LAUNCHER_ONLY}
    assert launcher_only <= set(switches) | set(lists["KIT_OTHER_VARIABLES"])
    assert {s.split(":")[0] for s in knobs.PRECISION_SWITCHES} <= launcher_only


def test_docs_knobs_md_is_what_config_py_generates():
    lines = (ROOT / "docs" / "knobs.md").read_text().splitlines()
    generated = knob_docs.markdown()
    at = lines.index(generated[0])
    assert lines[at : at + len(generated)] == generated, "docs/knobs.md is out of date: run `make knobs`"


@pytest.mark.parametrize("launcher", LAUNCHERS, ids=[lw.path.name for lw in LAUNCHERS])
def test_every_launchers_block_is_what_config_py_generates(launcher):
    lines = launcher.path.read_text().splitlines()
    block = knob_docs.launcher_block(launcher)
    assert block[0] in lines, f"{launcher.path.name}: no generated block: run `make knobs`"
    at = lines.index(block[0])
    assert lines[at : at + len(block)] == block, f"{launcher.path.name} is out of date: run `make knobs`"


def test_the_launchers_are_found_by_what_they_run():
    found = {lw.path.name: (lw.mode, lw.preset) for lw in LAUNCHERS}
    # the design card's four (a new one joins by calling kit_launch, as train_dpo.sh will)
    assert {"run_single_gpu.sh", "run_single_gpu_optimized.sh", "train_sft_custom.sh", "quick_start_sft_fast.sh"} <= set(found)
    assert found["run_single_gpu.sh"] == ("pretrain", "baseline") and found["train_sft_custom.sh"][0] == "sft"
    assert all(mode in config.MODES and preset in config.PRESETS for mode, preset in found.values())
    assert not any(p.name in found for p in ROOT.glob("scripts/*.sh"))  # only the root's scripts


def test_every_field_appears_in_the_docs_and_a_mode_only_knob_in_exactly_its_modes_launchers():
    doc = "\n".join(knob_docs.markdown())
    rows = [line.split(" | ")[0].removeprefix("| ") for line in doc.splitlines() if line.startswith("| ")]
    user_fields = [n for n in FIELDS if n not in knobs.marked("command")]
    expected_rows = [config.env_name(n) for n in user_fields] + [v for v, *_ in knob_docs.LAUNCHER_ONLY]
    assert sorted(r for r in rows if r not in ("launcher variable", "---")) == sorted(expected_rows)
    mode_marks = set(MARKS) & set(config.MODES)
    assert mode_marks, "no marker names a mode"
    for launcher in LAUNCHERS:
        top = {line.split("=")[0] for line in knob_docs.launcher_block(launcher) if knob_docs.KNOB_LINE.match(line)}
        for name in user_fields:
            marks = set(FIELDS[name].metadata.get("marks", ()))
            modes, refused = marks & mode_marks, f"not_{launcher.mode}" in marks
            assert (config.env_name(name) in top) == ((not modes or launcher.mode in modes) and not refused), (
                launcher.path.name, name)
    sft_launchers = {lw.path.name for lw in LAUNCHERS if lw.mode == "sft"}
    assert {"train_sft_custom.sh", "quick_start_sft_fast.sh"} <= sft_launchers


def test_markers_pick_the_lists_and_their_fields_fit_them():
    assert set(AUTO_FIELDS) == set(knobs.marked("auto")) and AUTO_FIELDS
    for name in AUTO_FIELDS:  # empty / auto / none: the run decides, so the field defaults to None
        assert FIELDS[name].default is None and parse_value(name, "auto") is None and parse_value(name, "none") is None
    assert set(SFT_ONLY) == set(knobs.marked("sft")) and SFT_ONLY
    for name in SFT_ONLY:  # "set" means not the default, and pretraining refuses it by its variable
        assert FIELDS[name].default in (None, False)
        kind, choices = FIELDS[name].type.split("|")[0].strip(), FIELDS[name].metadata.get("choices")
        cfg = config.resolve(None, {})
        knobs.set_value(cfg, name, {"bool": True, "int": 1, "float": 1.0}.get(kind, choices[0] if choices else "x"))
        with pytest.raises(UsageError, match=rf"^{config.env_name(name)} \(--{name}\) is an SFT setting"):
            refuse_sft_settings(cfg)
    assert set(COMPARED) == set(knobs.marked("compared")) and COMPARED
    assert not set(COMPARED) & set(knobs.marked("command"))
    assert all(FIELDS[name].type == "bool" for name in knobs.marked("switch"))


def test_a_misspelled_marker_stops_at_import():
    with pytest.raises(ValueError, match="unknown knob marker"):
        knob(None, "compare")


def test_the_comment_rules():
    by_name = {k.name: k for k in knob_docs.all_knobs()}
    optimized = next(lw for lw in LAUNCHERS if lw.path.name == "run_single_gpu_optimized.sh")
    block = "\n".join(knob_docs.launcher_block(optimized))
    # a launcher's own default is read back; an empty one says what empty gives (preset, default, doc)
    assert "BATCH_SIZE=${BATCH_SIZE:-32} " in block and "TF32=${TF32:-1} " in block
    assert knob_docs.empty_means(by_name["weight_decay"], "sft") == "empty: 0 (preset sft)"
    assert knob_docs.empty_means(by_name["learning_rate"], None) == "empty: 6e-4"
    assert knob_docs.empty_means(by_name["lora_r"], "sft") == "empty or 0: full fine-tuning"
    assert knob_docs.empty_means(by_name["truncation"], "sft").startswith("empty: keep_end (")
    # choices explained at length become their names; a mode's prefix goes; long text is cut at a clause
    assert knob_docs.summary(by_name["lr_schedule"]) == "cosine | linear | constant | onecycle"
    assert knob_docs.summary(by_name["lora_alpha"]) == "LoRA's scale is LORA_ALPHA / LORA_R"
    assert all(len(knob_docs.summary(k)) <= knob_docs.COMMENT_WIDTH + 40 for k in by_name.values())
    assert knob_docs.shown(str(config.KIT_DIR / "runs")) == "runs"  # no machine's path in the docs


def test_the_knobs_command(capsys):
    from train.cli import main

    assert main(["knobs", "--check"]) == 0
    assert main(["knobs", "--launcher", "run_single_gpu.sh"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == knob_docs.SH_END
    with pytest.raises(UsageError, match="--launcher: expected one of .*run_single_gpu.sh"):
        main(["knobs", "--launcher", "nope.sh"])
    with pytest.raises(UsageError, match=r"^knobs: expected --markdown \| --launcher NAME \| --write \| --check, got '--bogus'$"):
        main(["knobs", "--bogus"])
    assert main(["knobs"]) == 0 and "--write" in capsys.readouterr().out


@pytest.mark.parametrize("launcher", LAUNCHERS, ids=[lw.path.name for lw in LAUNCHERS])
def test_a_launcher_written_before_the_markers_gets_its_block_in_place_of_its_knob_lines(launcher, tmp_path):
    text = launcher.path.read_text()
    # as the launchers were written by hand: no BEGIN/END lines, other comments on the knob lines
    old = "\n".join(line.split("  #")[0].rstrip() + "  # said by hand" if knob_docs.KNOB_LINE.match(line) else line
                    for line in text.splitlines() if not line.startswith(("# BEGIN knobs", "# END knobs")))  # fmt: skip
    copy = tmp_path / launcher.path.name
    copy.write_text(old + "\n")
    block = knob_docs.launcher_block(knob_docs.Launcher(copy, launcher.mode, launcher.preset))
    assert "\n".join(knob_docs.rewritten(old.splitlines(), block)) + "\n" == text  # the defaults kept
