"""Preference training's loss (DPO and its kin): per-sequence log-probs of the responses without the
(tokens x vocab) logits (logps), the losses by name and the step's share of them (loss), and the
reference model's log-probs three ways (reference). Imports torch, peft where asked, and train/core's
other modules only."""

from train.core.preference.logps import Responses, sequence_logps
from train.core.preference.loss import DPO_LOSS, PreferenceObjective, preference_loss, step_counts
from train.core.preference.reference import REFERENCES, build_reference, reference_over

__all__ = [
    "DPO_LOSS",
    "REFERENCES",
    "PreferenceObjective",
    "Responses",
    "build_reference",
    "preference_loss",
    "reference_over",
    "sequence_logps",
    "step_counts",
]
