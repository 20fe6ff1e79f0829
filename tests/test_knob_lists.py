"""The knob lists are derived from config.py's fields, their markers (knob(default, "auto",
"compared", ...)) and the modes that read them (knob(modes=...)): the launchers' variable lists
(scripts/common.sh asks Python once per start), the flags that take "auto", the refusal of a knob
its mode does not read (flags, plan and launchers alike) and the settings a resume compares. The
knob tables of docs/knobs.md and the block of knob lines at the top of every launcher are generated
from the same fields (`make knobs`), so here the committed text must be the generated text, and the
rules that pick a knob's launchers are checked against the fields, not against a list kept here."""

from __future__ import annotations

import dataclasses
import inspect
import os
import shlex
import subprocess

import pytest

import config
from conftest import ROOT, launch, run_cli
from train.config import knob_docs, knobs
from train.config.flags import AUTO_FIELDS, parse_training_args, parse_value, training_parser
from train.core.checks import knob
from train.core.errors import UsageError
from train.run.checkpoint.manager import COMPARED

FIELDS = {f.name: f for klass in config.SECTIONS.values() for f in dataclasses.fields(klass)}
LAUNCHERS = knob_docs.launchers()


def shell_lists() -> dict[str, list[str]]:
    """The arrays scripts/common.sh holds once sourced (as the launchers see them)."""
    script = 'source scripts/common.sh; for a in KIT_VALUE_KNOBS KIT_SWITCH_KNOBS KIT_OTHER_VARIABLES ' \
             'KIT_MODE_KNOBS KIT_MODE_NAMES; do declare -n list=$a; IFS="|"; echo "$a|${list[*]}"; ' \
             'done'  # fmt: skip
    env = {"KIT_NAMES_CHECKED": "1", "PATH": os.environ["PATH"]}
    out = subprocess.run(
        ["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, check=True, env=env
    )
    lists = {line.split("|")[0]: line.split("|")[1:] for line in out.stdout.splitlines()}
    return {name: items if name == "KIT_MODE_NAMES" else " ".join(items).split()
            for name, items in lists.items()}


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
    assert switches == {
        "ENABLE_FP16": "fp16",
        "ENABLE_BF16": "bf16",
        "ENABLE_GRAD_CKPT": "gradient_checkpointing",
    }
    flags = {a.dest for a in training_parser("pretrain")._actions}
    assert set(values.values()) | set(switches.values()) <= flags
    # the launcher-only variables the generated blocks add are the kit's own (no misspelling warning)
    launcher_only = {variable for variable, *_ in knob_docs.LAUNCHER_ONLY}
    assert launcher_only <= set(switches) | set(lists["KIT_OTHER_VARIABLES"])
    assert {s.split(":")[0] for s in knobs.PRECISION_SWITCHES} <= launcher_only
    # the modes that read each knob, and the modes' names, for the launchers' refusal
    assert (lists["KIT_MODE_KNOBS"], lists["KIT_MODE_NAMES"]) == knobs.launcher_modes()
    assert "TEXT_FIELD:pretrain,sft" in lists["KIT_MODE_KNOBS"]
    assert "dpo=preference training" in lists["KIT_MODE_NAMES"]
    assert not any(item.startswith("BATCH_SIZE:") for item in lists["KIT_MODE_KNOBS"])  # every mode reads it


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
    assert {
        "run_single_gpu.sh",
        "run_single_gpu_optimized.sh",
        "train_sft_custom.sh",
        "quick_start_sft_fast.sh",
    } <= set(found)
    assert found["run_single_gpu.sh"] == ("pretrain", "baseline") and found["train_sft_custom.sh"][0] == "sft"
    assert all(mode in config.MODES and preset in config.PRESETS for mode, preset in found.values())
    assert not any(p.name in found for p in ROOT.glob("scripts/*.sh"))  # only the root's scripts


def test_every_field_appears_in_the_docs_and_each_launcher_has_exactly_its_modes_knobs():
    doc = "\n".join(knob_docs.markdown())
    rows = [line.split(" | ")[0].removeprefix("| ") for line in doc.splitlines() if line.startswith("| ")]
    user_fields = knobs.user_knobs()
    assert set(user_fields) == set(FIELDS) - set(knobs.marked("command"))
    expected_rows = [config.env_name(n) for n in user_fields] + [v for v, *_ in knob_docs.LAUNCHER_ONLY]
    assert sorted(r for r in rows if r not in ("launcher variable", "---")) == sorted(expected_rows)
    for launcher in LAUNCHERS:
        top = {line.split("=")[0] for line in knob_docs.launcher_block(launcher)
               if knob_docs.KNOB_LINE.match(line)}
        own = {config.env_name(n) for n in user_fields if launcher.mode in knobs.modes(n)}
        assert top == own | {v for v, *_ in knob_docs.LAUNCHER_ONLY}, launcher.path.name
    sft_launchers = {lw.path.name for lw in LAUNCHERS if lw.mode == "sft"}
    assert {"train_sft_custom.sh", "quick_start_sft_fast.sh"} <= sft_launchers
    # the case: preference training packs, and takes no text field, BPE sample or new model's family
    dpo = next(lw for lw in LAUNCHERS if lw.path.name == "train_dpo.sh")
    dpo_top = {line.split("=")[0] for line in knob_docs.launcher_block(dpo)
               if knob_docs.KNOB_LINE.match(line)}
    assert "PACKING" in dpo_top and not {"TEXT_FIELD", "TOKENIZER_SAMPLE_MB", "MODEL_FAMILY"} & dpo_top
    # docs/knobs.md says each knob's modes: every mode's, or a group headed by the modes that read it
    for modes in {knobs.modes(n) for n in user_fields} - {frozenset(config.MODES)}:
        named = " | ".join(m for m in config.MODES if m in modes)
        assert f"Read by `python -m train {named}` only (launchers: " in doc, named


def test_the_modes_of_a_knob_are_said_once_and_read_alike():
    """knob(modes=...) is the one place: every mode it names exists, every mode reads some knob, the groups
    are sets of modes; the flags, --help, the plan's check and the docs read knobs.modes()."""
    every = set().union(*(knobs.modes(n) for n in knobs.user_knobs()))
    assert every == set(config.MODES)
    assert all(set(group) <= set(config.MODES) for group in (config.EVERY, config.FINE_TUNING,
                                                              config.FROM_SCRATCH))
    assert knobs.modes("text_field") == {"pretrain", "sft"} and knobs.modes("packing") == {"sft", "dpo"}
    # one field, two defaults
    assert knobs.modes("loss_on") == {"sft"} and knobs.modes("beta") == {"dpo", "grpo"}
    assert knobs.modes("seed") == config.EVERY
    by_name = {k.name: k for k in knob_docs.all_knobs()}
    for mode in config.MODES:
        shown = {a.dest for a in training_parser(mode)._actions if a.help != "==SUPPRESS=="}
        for name in knobs.user_knobs():
            reads = knobs.applies(name, mode)
            assert knob_docs.applies(by_name[name], mode) == reads == (name in shown), (mode, name)
    for bad in ("sft", (), [1]):  # a bare string would read as its letters
        with pytest.raises(ValueError, match="knob modes: expected a set of mode names"):
            knob(None, modes=bad)


def a_value(name: str):
    """A value of the field's type other than its default."""
    kind, choices = FIELDS[name].type.split("|")[0].strip(), FIELDS[name].metadata.get("choices")
    if choices:
        return next(c for c in choices if c != knobs.default(name))
    return {"bool": True, "int": 300, "float": 0.25}.get(kind, "x")


def test_a_knob_its_mode_does_not_read_is_refused_when_set():
    for mode in config.MODES:
        for name in (n for n in knobs.user_knobs() if not knobs.applies(n, mode)):
            message = (f"^{config.env_name(name)} \\(--{name}\\) does not apply to {knobs.mode_name(mode)} "
                       f"\\(`python -m train {mode}`\\): it is read by {knobs.readers(name)} only; leave it "
                       "empty$")
            cfg = config.resolve(None, {"mode": mode})
            knobs.refuse_unread(cfg)  # nothing set: nothing refused
            knobs.set_value(cfg, name, a_value(name))
            with pytest.raises(UsageError, match=message):  # a config made in code (the plan's check)
                knobs.refuse_unread(cfg)
            for text in ("1" if FIELDS[name].type == "bool" else str(a_value(name)), "0"):
                with pytest.raises(UsageError, match=message):  # a flag given at all, even at the default
                    parse_training_args(mode, [f"--{name}", text])
            parse_training_args(mode, [f"--{name}", ""])  # empty: not set
    assert knobs.refusal("text_field", "dpo") == (
        "TEXT_FIELD (--text_field) does not apply to preference training (`python -m train dpo`): it is "
        "read by pretraining and SFT only; leave it empty")


DPO_REFUSAL = ("error: TEXT_FIELD does not apply to preference training (train_dpo.sh): it is read by "
               "pretraining and SFT only; leave it empty\n")


def test_a_launcher_refuses_a_variable_its_mode_does_not_read_before_any_work(tmp_path):
    runs = tmp_path / "runs"
    refused = launch("train_dpo.sh", {"TEXT_FIELD": "body", "OUTPUT_DIR": str(runs), "RUN_NAME": "r"})
    assert (refused.returncode, refused.stdout, refused.stderr) == (2, "", DPO_REFUSAL)
    assert not runs.exists()  # no run folder, no Python run started
    kept = launch("train_sft_custom.sh", {"TEXT_FIELD": "body", "SHOW_COMMAND": "1"})  # SFT reads it
    assert kept.returncode == 0 and "--text_field body" in kept.stdout, kept.stderr


def test_the_flag_of_a_knob_its_mode_does_not_read_is_refused_before_any_work(tmp_path, capsys):
    runs = tmp_path / "runs"
    assert run_cli("dpo", "--text_field", "body", "--output_dir", str(runs), "--run_name", "r") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: " + knobs.refusal("text_field", "dpo")] and not runs.exists()


def test_a_launchers_own_default_of_a_knob_its_mode_does_not_read_is_left_out_not_refused(tmp_path):
    """KIT_GIVEN says which variables the user set: a default the launcher itself sets (a launcher edited by
    hand, or one older than its mode's knobs) is no user's, so it is not passed, and the run goes on."""
    kit = tmp_path / "kit"
    kit.mkdir()
    for name in ("config.py", "train", "scripts", ".venv"):
        if (ROOT / name).exists():
            (kit / name).symlink_to(ROOT / name)
    text = (ROOT / "train_dpo.sh").read_text()
    given = next(line for line in text.splitlines() if line.startswith("KIT_GIVEN="))
    (kit / "my_dpo.sh").write_text(text.replace(given, given + "\nTEXT_FIELD=${TEXT_FIELD:-body}", 1))
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR")}
    run = [["bash", str(kit / "my_dpo.sh")], dict(cwd=kit, capture_output=True, text=True, timeout=120)]
    shown = subprocess.run(run[0], env={**env, "SHOW_COMMAND": "1"}, **run[1])
    argv = shlex.split(shown.stdout)
    assert shown.returncode == 0 and shown.stderr == "" and argv[3] == "dpo" and "--text_field" not in argv
    refused = subprocess.run(run[0], env={**env, "SHOW_COMMAND": "1", "TEXT_FIELD": "body"}, **run[1])
    assert (refused.returncode, refused.stdout) == (2, "")
    assert refused.stderr == DPO_REFUSAL.replace("train_dpo.sh", "my_dpo.sh")


def test_a_modes_own_defaults_are_config_py_s_real_values():
    dpo, pretrain = config.resolve("dpo", {"mode": "dpo"}), config.resolve(None, {"mode": "pretrain"})
    for name, value in config.MODE_DEFAULTS["dpo"].items():
        assert knobs.value(dpo, name) == value == knobs.default(name, "dpo")
        assert knobs.value(pretrain, name) is None and knobs.default(name) is None  # not read there: unset
    assert knobs.value(config.resolve("dpo", {"mode": "dpo", "beta": 0.3}), "beta") == 0.3  # a flag wins
    assert set(config.MODE_DEFAULTS) <= set(config.MODES)
    assert all(m in knobs.modes(n) for m, own in config.MODE_DEFAULTS.items() for n in own)
    # the preference library's own keyword defaults (train/core is below config.py and cannot read it) agree
    from train.core.preference.loss import PreferenceObjective, preference_loss

    library = {**{k: v.default for k, v in inspect.signature(preference_loss).parameters.items()},
               "dpo_loss": inspect.signature(preference_loss).parameters["loss"].default}
    fields = {f.name: f.default for f in dataclasses.fields(PreferenceObjective)}
    for name, value in config.MODE_DEFAULTS["dpo"].items():
        assert library[name] == value and fields["loss_name" if name == "dpo_loss" else name] == value, name
    for launcher in LAUNCHERS:  # its preset sets only knobs its mode reads (else every run is refused)
        preset = config.PRESETS[launcher.preset]
        assert all(knobs.applies(n, launcher.mode) for n in preset), launcher.path.name


def test_a_misspelled_mode_stops_at_import(tmp_path):
    kit = tmp_path / "kit"
    kit.mkdir()
    for name in ("train", "scripts", ".venv"):
        if (ROOT / name).exists():
            (kit / name).symlink_to(ROOT / name)
    text = (ROOT / "config.py").read_text()
    assert text.count('modes={"dpo"}, least=0.0, below=0.5') == 1  # LABEL_SMOOTHING's
    (kit / "config.py").write_text(text.replace('modes={"dpo"}, least=0.0', 'modes={"dp"}, least=0.0', 1))
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR")}
    out = subprocess.run(["bash", "-c", "source scripts/common.sh"], cwd=kit, env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and out.stderr == (
        "error: config.py cannot be read: ValueError: config.py: label_smoothing's knob(modes=...) names "
        "['dp'], not a mode of MODES (pretrain | sft | dpo | grpo)\n")


def test_markers_pick_the_lists_and_their_fields_fit_them():
    assert set(AUTO_FIELDS) == set(knobs.marked("auto")) and AUTO_FIELDS
    for name in AUTO_FIELDS:  # empty / auto / none: the run decides, so the field defaults to None
        assert (
            FIELDS[name].default is None
            and parse_value(name, "auto") is None
            and parse_value(name, "none") is None
        )
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
    with pytest.raises(UsageError, match=r"^knobs: expected --markdown \| --launcher NAME \| --write \| "
                                         r"--check, got '--bogus'$"):
        main(["knobs", "--bogus"])
    assert main(["knobs"]) == 0 and "--write" in capsys.readouterr().out


@pytest.mark.parametrize("launcher", LAUNCHERS, ids=[lw.path.name for lw in LAUNCHERS])
def test_a_launcher_written_before_the_markers_gets_its_block_in_place_of_its_knob_lines(launcher, tmp_path):
    text = launcher.path.read_text()
    # as the launchers were written by hand: no BEGIN/END lines, other comments on the knob lines
    old = "\n".join(
        line.split("  #")[0].rstrip() + "  # said by hand" if knob_docs.KNOB_LINE.match(line) else line
        for line in text.splitlines()
        if not line.startswith(("# BEGIN knobs", "# END knobs"))
    )
    copy = tmp_path / launcher.path.name
    copy.write_text(old + "\n")
    block = knob_docs.launcher_block(knob_docs.Launcher(copy, launcher.mode, launcher.preset))
    assert "\n".join(knob_docs.rewritten(old.splitlines(), block)) + "\n" == text  # the defaults kept
