"""A mode is an objective (train/core/objective.py): every objective answers the whole Objective protocol,
each mode's row names a real objective class, the shared parts' answers come from the objective (the log
line, validation's weights and words, summary.json's metrics), and REFERENCE=precomputed's log-probs are
fields the preference collator itself puts in the batch (dpo_reference.carrying: the same collator kind and
settings, no wrapper forwarding attributes)."""

from __future__ import annotations

import inspect

import pytest
import torch

from train.core.objective import MODES, Objective, mode_of
from train.core.preference.loss import PreferenceObjective
from train.core.reward.guard import RewardSet
from train.core.reward.knobs import GrpoKnobs
from train.core.reward.objective import GRPOObjective
from train.core.reward.sampling import Sampler, SamplingSettings
from train.core.step import TokenObjective
from train.data.chat.packing import VARLEN
from train.data.chat.pair_batching import (
    MicroPackedPairCollator,
    PackedPairCollator,
    PairCollator,
    Seq2SeqPairCollator,
)
from train.run.plan import dpo_reference

GRPO = GRPOObjective(False, GrpoKnobs(), Sampler(SamplingSettings(), eos_ids=[0], pad_id=0, device="cpu"),
                     RewardSet(()), [[1]], lambda index, repeat: ([], {}))  # fmt: skip
OBJECTIVES = (
    TokenObjective(False),
    TokenObjective(True, micro_batch_mean=True),
    PreferenceObjective(False),
    GRPO,
)


def protocol_members() -> set[str]:
    return {n for n in (*vars(Objective), *Objective.__annotations__) if not n.startswith("_")}


@pytest.mark.parametrize("objective", OBJECTIVES, ids=lambda o: type(o).__name__)
def test_every_objective_answers_the_whole_protocol(objective):
    members = protocol_members()
    assert {"counts", "loss", "returned", "named", "samples", "shown", "evaluate", "perplexity", "eval_shown",
            "kept", "describe", "rows_per_sample", "unit", "trial_on_longest", "layout"} <= members
    missing = sorted(n for n in members if not hasattr(objective, n))
    assert missing == []
    for name in members:  # the methods take what the protocol's take, by name and in order
        spec = getattr(Objective, name, None)
        if inspect.isfunction(spec):
            asked = list(inspect.signature(spec).parameters)[1:]  # less self
            assert list(inspect.signature(getattr(objective, name)).parameters) == asked, name


def test_each_modes_row_names_a_real_objective_class():
    assert set(MODES) == {"pretrain", "sft", "dpo", "grpo"}  # config.py's modes
    assert mode_of("grpo").objective_class is GRPOObjective and mode_of("grpo").unit == "prompts"
    assert mode_of("pretrain").objective_class is TokenObjective
    assert mode_of("sft").objective_class is TokenObjective
    assert mode_of("dpo").objective_class is PreferenceObjective
    assert (mode_of("dpo").rows_per_sample, mode_of("dpo").unit) == (2, "pairs")
    assert (mode_of("sft").rows_per_sample, mode_of("sft").unit) == (1, "samples")
    assert [m for m, row in MODES.items() if row.throughput == "tokens_per_sec"] == ["sft"]


def test_the_log_line_validation_and_summary_fields_come_from_the_objective():
    token, pairs = TokenObjective(False), PreferenceObjective(False)
    row = {"mean_token_accuracy": 0.25, "rewards/accuracies": 0.75, "rewards/margins": 0.125}
    assert token.shown(row) == "acc 0.250"
    assert pairs.shown(row) == "acc 0.750 margin 0.125"
    assert token.eval_shown(1.0, {}) == "val_ppl 2.72" and token.eval_shown(float("nan"), {}) == "val_ppl n/a"
    assert pairs.perplexity(1.0) is None and token.perplexity(1.0) == pytest.approx(2.718281828)
    metrics = {"rewards/chosen": 1.0, "rewards/accuracies": 0.5, "logps/chosen": -3.0, "nll_loss": 2.0}
    assert pairs.kept(metrics) == {"rewards/chosen": 1.0, "rewards/accuracies": 0.5}
    assert token.kept(metrics) == {}
    packed = {"input_ids": torch.zeros(2, 8, dtype=torch.long), "n_conversations": 5}
    assert token.samples(packed) == 5 and token.samples({"input_ids": torch.zeros(3, 8)}) == 3
    assert pairs.samples({"input_ids": torch.zeros(6, 8), "n_pairs": 3}) == 3
    assert token.named(torch.tensor(0.5)) == {"mean_token_accuracy": torch.tensor(0.5)}
    assert token.describe() == "token loss"
    assert PreferenceObjective(False, "ipo").describe() == "preference loss ipo"


def _pairs(n: int) -> list[dict]:
    out = []
    for i in range(n):
        prompt, chosen, rejected = [5] * (2 + i), [6] * (1 + i % 2), [7] * (3 - i % 2)
        out.append(
            {
                "prompt_ids": prompt,
                "chosen_ids": chosen,
                "rejected_ids": rejected,
                "chosen_labels": chosen,
                "rejected_labels": rejected,
                dpo_reference.PRECOMPUTED[0]: -1.0 - i,
                dpo_reference.PRECOMPUTED[1]: -10.0 - i,
            }
        )
    return out


@pytest.mark.parametrize("collate, rows", [
    (PairCollator(0, pad_to_multiple_of=8), False),
    (Seq2SeqPairCollator(0), False),
    (MicroPackedPairCollator(0, attention=VARLEN), False),
    (PackedPairCollator(0, attention=VARLEN), True),
], ids=lambda c: type(c).__name__)
def test_the_collator_itself_carries_the_reference_log_probs(collate, rows):
    collate.widths = (16, 32)  # a setting the data's front door makes after construction (length buckets)
    made = dpo_reference.carrying(collate)
    assert isinstance(made, type(collate)) and made is not collate and vars(made) == vars(collate)
    assert not hasattr(type(made), "__getattr__")  # no forwarding: the plain collator's own attributes
    assert made.length_varies == collate.length_varies
    pairs = _pairs(3)
    items = [pairs[:2], pairs[2:]] if rows else pairs
    plain, carried = collate(items), made(items)
    assert set(carried) - set(plain) == set(dpo_reference.PRECOMPUTED)
    for key in plain:
        if torch.is_tensor(plain[key]):
            assert torch.equal(plain[key], carried[key]), key
        else:
            assert plain[key] == carried[key], key
    assert carried["ref_chosen_logps"].tolist() == [-1.0, -2.0, -3.0]  # the pairs' order in the batch
    assert carried["ref_rejected_logps"].tolist() == [-10.0, -11.0, -12.0]
    assert dpo_reference.PRECOMPUTED[0] not in collate(items)  # the given collator left as it was


def test_a_collator_with_no_carrying_form_is_refused():
    with pytest.raises(TypeError, match="no reference-carrying form of"):
        dpo_reference.carrying(lambda items: {})
