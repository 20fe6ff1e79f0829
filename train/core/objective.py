"""A mode is an objective: everything a mode changes in the shared parts is asked of it here.

Objective is what train_step (train/core/step.py), the loop's meter and validation (train/run/loop) and
the tools ask of a mode's loss; none of them asks which mode it serves. TokenObjective (pretraining and
SFT, core/step.py) and PreferenceObjective (DPO and its kin, core/preference/loss.py) implement it; a
new mode's objective (GRPO's: sampled completions, rewards, a clipped policy-gradient loss) implements
the same methods and adds one row to MODES (below), and the loop runs it unchanged.

What the parts ask, each in one place:
- the step: counts (the step's divisors, host ints), loss (a micro-batch's share and its metrics as
  device tensors), returned (a log step's fourth value from the metrics summed over the micro-steps);
- the meter: samples (a batch's samples: rows, packed conversations, pairs), named (a log step's
  metrics by name, read at the log line's one sync), shown (the log line's mode fields);
- validation: evaluate (a batch's weight, mean loss and metric means), perplexity, eval_shown;
- summary.json: kept (the logged metrics it keeps as final_<name>);
- the tools: describe (a trial step's loss in words), unit and rows_per_sample (class values, read
  before an objective exists through MODES), trial_on_longest (find-batch's trial batches).

MODES: what a mode means to the parts that run before its objective exists (the plan's memory estimate,
fill and adapt, find-batch's and autotune's words) or without one (compare reads a run's summary.json):
one row per mode, its objective's class among its fields. The shared parts look a mode up (mode_of)
and read the row's facts; none of them compares a mode's name. A new mode is a new row. The class is
named, imported where its facts are read: compare reads summary.json without torch.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch


class Objective(Protocol):
    """A mode's loss and everything the shared parts ask of it (see the module doc)."""

    rows_per_sample: ClassVar[int]
    """Sequences one sample puts through the forward: 1, or 2 for a pair (chosen and rejected)."""
    unit: ClassVar[str]
    """What a sample is called in the tools' rates and find-batch's answer: samples, pairs."""
    trial_on_longest: ClassVar[bool]
    """find-batch's trial batches: the data's longest samples as the run's collator makes them (True),
    or worst-case rows of MAX_LENGTH random tokens (False)."""
    layout: Any  # the model's family's Layout (train/models/family.py): causal LM or encoder-decoder

    def counts(self, micro_batches: list[dict]) -> Any:
        """The optimizer step's divisors, counted on the host from its micro-batches (no device sync);
        with several ranks each is summed over them (distributed.step_total)."""

    def loss(self, model, batch: dict, device: torch.device, precision: str, counts, world_size: int = 1,
             accuracy: bool = False) -> tuple[torch.Tensor, dict]:
        """(this micro-batch's share of the step's loss, its metrics as device tensors)."""

    def returned(self, sums: dict) -> Any:
        """train_step's fourth value on a log step, from the metrics summed over the micro-steps."""

    def named(self, returned) -> dict:
        """That fourth value as {metric name: device tensor}: the metrics row's fields, in order."""

    def samples(self, batch: dict) -> int:
        """The samples a collated batch holds (the meter's count, samples_per_sec's numerator)."""

    def shown(self, row: dict) -> str:
        """The log line's mode fields from its metrics row (after the loss)."""

    def evaluate(self, model, batch: dict, device: torch.device,
                 precision: str) -> tuple[int, torch.Tensor, dict]:
        """(the batch's weight, its mean loss, its metrics' means): validation sums each x weight."""

    def perplexity(self, loss: float | None) -> float | None:
        """val_ppl: exp of a token mean loss; None where the loss is no token loss."""

    def eval_shown(self, loss: float, metrics: dict) -> str:
        """The validation line's fields after val_loss."""

    def kept(self, metrics: dict) -> dict:
        """The logged metrics summary.json keeps (as final_<name> and final_val_<name>)."""

    def describe(self) -> str:
        """The loss in words (find-batch's answer and log)."""

    # Optional, asked only where an objective has it (getattr): rollout(model, micro_batches) -> the
    # micro-batches the step trains on, made under the current weights before the step is counted (GRPO's
    # sampled, scored completions), its seconds in rollout_seconds (the meter's generation_frac); and
    # generators() -> {name: torch.Generator} whose states a checkpoint keeps; state_dict() /
    # load_state_dict(state) -> what else of its own a checkpoint keeps, each rank's (plain values and host
    # tensors; GRPO's scored micro-batches, shared by one generation's steps), load_state_dict raising
    # ValueError before it changes anything where a state is malformed (the checkpoint's check tries it);
    # trial_batch(model, batch) -> the batch COMPILE's trial step trains on in place of the loader's (GRPO's:
    # scored rows made without sampling); length_varies: its rows pad to length buckets (compiled: lengths
    # dynamic).


def perplexity(loss: float | None) -> float | None:
    """exp(loss) of a token mean loss; None for none or a non-finite one, inf past exp's range."""
    if loss is None or not math.isfinite(loss):
        return None
    return math.exp(loss) if loss < 700 else math.inf


@dataclass(frozen=True)
class Mode:
    """One mode's row: its objective's class, and what differs between modes that share one."""

    objective: str
    """The step's objective class (Objective, above), as module:Class: rows_per_sample, unit."""
    throughput: str = "samples_per_sec"
    """compare's headline figure: tokens_per_sec where samples vary in length (SFT's conversations: a
    side of single conversations and one of grouped batches count samples very differently)."""
    span_targets: bool = False
    """An encoder-decoder's targets are span corruption's (raw text), not a MAX_LENGTH bound."""
    fills_causal: bool = True
    """No BATCH_SIZE of the user's: a causal model's micro-batch fills the GPU too (an encoder-decoder's
    always does). Pretraining's packed windows keep the preset: compute-bound (find-batch measures)."""
    row_lengths: bool = False
    """The dataset's lengths are its rows' (the estimate reads the longest padded row); else the mode's
    bound (a pair's lengths are the samplers' cost, not a row)."""
    sampled: bool = False
    """Its rows are sampled in the step: NUM_GENERATIONS per sample, with a KV cache before the forwards (the
    estimate counts both), each a prompt and up to its dataset's completion_length tokens after it."""

    @property
    def objective_class(self) -> type:
        module, name = self.objective.split(":")
        return getattr(importlib.import_module(module), name)

    @property
    def rows_per_sample(self) -> int:
        return self.objective_class.rows_per_sample

    @property
    def unit(self) -> str:
        return self.objective_class.unit


TOKEN, PREFERENCE = "train.core.step:TokenObjective", "train.core.preference.loss:PreferenceObjective"
REWARD = "train.core.reward.objective:GRPOObjective"
MODES = {
    "pretrain": Mode(TOKEN, span_targets=True, fills_causal=False),
    "sft": Mode(TOKEN, throughput="tokens_per_sec", row_lengths=True),
    "dpo": Mode(PREFERENCE),  # the fill's room for REFERENCE: DPOSource.fill_reference
    # GRPO: the fill sizes prompts, NUM_GENERATIONS rows each at the longest prompt + MAX_COMPLETION_LENGTH
    # (adapt.row_shape); its room for REFERENCE: GRPOSource.fill_reference
    "grpo": Mode(REWARD, sampled=True),
}


def mode_of(name: str) -> Mode:
    """A mode's row (config.py's mode names: pretrain, sft, dpo)."""
    return MODES[name]
