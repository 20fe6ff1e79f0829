"""Every knob a user sets sits at the top of each launcher (issue 28, item 5): the list is derived
from config.py (its fields and markers), so a knob added there and missing here fails this test."""

from __future__ import annotations

import re

import pytest

import config
from conftest import ROOT
from train.config import knobs

PRETRAIN = ("run_single_gpu.sh", "run_single_gpu_optimized.sh")
SFT = ("train_sft_custom.sh", "quick_start_sft_fast.sh")
DPO = ("train_dpo.sh",)
# Fields that do not apply to SFT (the reason). None now: SFT builds a new model of MODEL_SIZE /
# MODEL_FAMILY / MODEL_CONFIG with a BPE of VOCAB_SIZE, and reads plain-text records by TEXT_FIELD.
NOT_FOR_SFT: dict[str, str] = {}
# Fields that do not apply to preference training (the reason): it fine-tunes a trained chat model on pairs.
NOT_FOR_DPO = {
    "model_size": "refused: no model is built new", "model_config": "refused: no model is built new",
    "model_family": "no model is built new", "vocab_size": "no tokenizer is trained",
    "tokenizer_sample_mb": "no tokenizer is trained", "text_field": "pairs have no plain-text records",
    "loss_on": "the replies only (LOSS_ON=all is refused)",
}
# Launcher variables that are no config field: the guides' precision switches and torchrun's count.
NOT_FIELDS = ("ENABLE_FP16", "ENABLE_BF16", "NPROC_PER_NODE")
KNOB_LINE = re.compile(r"^([A-Z][A-Z0-9_]*)=\$\{\1:-[^}]*\}\s*(#\s*\S.*)?$")


def expected(mode: str) -> set[str]:
    """The launcher variables of every config field a user sets in this mode."""
    names = [n for n in config.FIELD_SECTION if n not in knobs.marked("command")]
    if mode == "pretrain":
        names = [n for n in names if n not in knobs.marked("sft") + knobs.marked("dpo")]
    elif mode == "sft":
        names = [n for n in names if n not in NOT_FOR_SFT and n not in knobs.marked("dpo")]
    else:
        names = [n for n in names if n not in NOT_FOR_DPO]
    return {knobs.env_name(n) for n in names} | set(NOT_FIELDS)


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


@pytest.mark.parametrize("script", PRETRAIN + SFT + DPO)
def test_every_knob_of_config_py_is_at_the_top(script):
    mode = "pretrain" if script in PRETRAIN else "sft" if script in SFT else "dpo"
    text = (ROOT / script).read_text()
    assert missing(text, mode) == set(), f"{script}: add a commented line in its group for each"
    lines = top(text)
    assert [name for name, comment in lines.items() if not comment] == []  # every knob says what it does
    if mode == "pretrain":  # SFT-only knobs would be refused there, one line each
        sft_only = {knobs.env_name(n) for n in knobs.marked("sft")}
        assert sft_only and not sft_only & set(lines)
    dpo_only = {knobs.env_name(n) for n in knobs.marked("dpo")}  # refused outside preference training
    assert dpo_only and (dpo_only <= set(lines) if mode == "dpo" else not dpo_only & set(lines))


def test_a_knob_missing_at_the_top_is_named():
    text = (ROOT / "run_single_gpu.sh").read_text()
    without = re.sub(r"^PIN_MEMORY=.*\n", "", text, flags=re.M)
    assert missing(without, "pretrain") == {"PIN_MEMORY"}
    ungrouped = text.replace("# ---- ", "# ")  # lines outside the groups do not count
    assert "MODEL_SIZE" in missing(ungrouped, "pretrain")
    assert "PACKING" in expected("sft") and "PACKING" not in expected("pretrain")
    assert "MODEL_SIZE" in expected("sft") and set(NOT_FOR_SFT) <= set(config.FIELD_SECTION)
