"""docs/dpo.md's TRL names (the issue: it mapped SFT_WEIGHT to `rpo_alpha`, a name TRL 1.16 does not
have). The lists below are TRL 1.16.0's own, read from the installed package's dataclass fields
(trl/trainer/dpo_config.py, trl/experimental/cpo/cpo_config.py, orpo/orpo_config.py), DPOTrainer's
__init__ arguments and its loss_type error message; no TRL import here (tests never install peers)."""

from __future__ import annotations

import re

from conftest import ROOT

DPO_CONFIG = {  # DPOConfig's own fields, and the TrainingArguments fields the docs name
    "model_init_kwargs",
    "trust_remote_code",
    "router_aux_loss_coef",
    "disable_dropout",
    "dataset_num_proc",
    "max_length",
    "truncation_mode",
    "padding_free",
    "pad_to_multiple_of",
    "precompute_ref_log_probs",
    "precompute_ref_batch_size",
    "loss_type",
    "loss_weights",
    "ld_alpha",
    "f_divergence_type",
    "f_alpha_divergence_coef",
    "label_smoothing",
    "beta",
    "use_weighting",
    "discopop_tau",
    "activation_offloading",
    "sync_ref_model",
    "ref_model_mixup_alpha",
    "ref_model_sync_steps",
    "pad_token",
    "learning_rate",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
}
CPO_CONFIG = {
    "max_length",
    "max_completion_length",
    "beta",
    "label_smoothing",
    "loss_type",
    "disable_dropout",
    "cpo_alpha",
    "simpo_gamma",
    "alpha",
    "generate_during_eval",
    "is_encoder_decoder",
    "model_init_kwargs",
    "trust_remote_code",
    "dataset_num_proc",
}
ORPO_CONFIG = {"max_length", "max_completion_length", "beta", "disable_dropout", "padding_value",
               "generate_during_eval", "is_encoder_decoder", "model_init_kwargs", "trust_remote_code",
               "dataset_num_proc"}  # fmt: skip
DPO_TRAINER = {
    "model",
    "ref_model",
    "args",
    "data_collator",
    "train_dataset",
    "eval_dataset",
    "processing_class",
    "compute_metrics",
    "callbacks",
    "optimizers",
    "quantization_config",
    "peft_config",
}
CLASSES = {"DPOConfig", "CPOConfig", "ORPOConfig", "DPOTrainer"}
DPO_LOSS_TYPES = {"sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
                  "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm"}  # fmt: skip
CPO_LOSS_TYPES = {"sigmoid", "hinge", "ipo", "simpo", "alphapo"}
TRL_1_16 = DPO_CONFIG | CPO_CONFIG | ORPO_CONFIG | DPO_TRAINER | CLASSES
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
DOC = ROOT / "docs" / "dpo.md"


def table(text: str, heading: str) -> list[list[str]]:
    """The cells of the first Markdown table under `## heading`, header and rule left out."""
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in row.strip("|").split(" | ")] for row in rows[2:]]


def quoted(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def test_every_trl_name_in_dpo_md_is_trl_1_16s():
    text = DOC.read_text()
    names = table(text, "TRL's names")
    assert len(names) >= 10
    unknown, losses = [], []
    for _kit, trl in names:
        for item in quoted(trl):
            if IDENTIFIER.fullmatch(item):
                unknown += [item] if item not in TRL_1_16 else []
            else:  # a value: loss_type's names, quoted
                losses += re.findall(r'"([a-z_]+)"', item)
    assert not unknown, f"docs/dpo.md names these as TRL 1.16's, which it does not have: {unknown}"
    assert losses and set(losses) <= DPO_LOSS_TYPES | CPO_LOSS_TYPES, losses
    # the knobs table's TRL settings (`loss_type=[...]`, `label_smoothing`: a setting's name has an
    # underscore, the loss names do not) are TRL's names too
    for _knob, doc in table(text, "The knobs"):
        for item in quoted(doc):
            name = item.split("=", 1)[0]
            if "=" in item or "_" in name:
                assert name in TRL_1_16, f"The knobs: `{item}` is no TRL 1.16 setting"


def test_every_dpo_knob_has_its_trl_row():
    text = DOC.read_text()
    knobs = [row[0] for row in table(text, "The knobs")]
    assert {"DPO_LOSS", "BETA", "LABEL_SMOOTHING", "SIMPO_GAMMA", "SFT_WEIGHT", "REFERENCE"} <= set(knobs)
    mapped = " ".join(row[0] for row in table(text, "TRL's names"))
    assert [knob for knob in knobs if knob not in mapped] == []


def test_the_differences_from_trl_are_said_in_dpo_md():
    """ORPO's NLL (the reply only) and LABEL_SMOOTHING (not read by TRL 1.16's sigmoid) are where the
    kit is not TRL's formula: dpo.md says both, not only loss.py and coming-from.md."""
    text = DOC.read_text()
    assert "Each is TRL's formula" not in text
    differences = text.split("Where the kit and TRL 1.16 differ", 1)[1].split("\n\n", 1)[0]
    assert "ORPO's NLL" in differences and "prompt + reply" in differences
    assert "LABEL_SMOOTHING" in differences and "does not read" in differences
