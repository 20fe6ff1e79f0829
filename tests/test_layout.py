"""The encoder-decoder difference as one strategy object on the family (train/models/family.py Layout):
every family names its layout, and a caller asks the layout to count targets, make generation inputs or
choose its own collator instead of asking what the model is."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_sft_data import make_tokenizer

from train.core.errors import UsageError
from train.core.units import IGNORE_INDEX
from train.data.chat.batching import PadCollator, Seq2SeqCollator, padded
from train.data.chat.pair_batching import PairCollator, Seq2SeqPairCollator, padded_pairs
from train.models import FAMILIES, KINDS
from train.models.family import CAUSAL_LM, ENCODER_DECODER


def test_every_family_names_its_layout_and_the_names_stay_the_caches_keys():
    assert {n: f.layout for n, f in FAMILIES.items()} == {"gpt2": CAUSAL_LM, "t5": ENCODER_DECODER,
                                                          "llama": CAUSAL_LM, "qwen3": CAUSAL_LM}
    assert KINDS["causal"].layout is CAUSAL_LM and KINDS["seq2seq"].layout is ENCODER_DECODER
    # summary.json's model_kind and a part of every chat cache's key: the names from before the Layout
    assert (CAUSAL_LM.name, ENCODER_DECODER.name) == ("causal", "seq2seq")


def test_a_causal_lms_targets_are_shifted_an_encoder_decoders_are_not():
    labels = torch.tensor([[5, 6, IGNORE_INDEX, 7], [IGNORE_INDEX, 8, 9, IGNORE_INDEX]])
    batch = {"input_ids": torch.zeros_like(labels), "labels": labels}
    assert CAUSAL_LM.count_targets(batch) == 4  # the first label of a row is never a target
    assert ENCODER_DECODER.count_targets(batch) == 5  # every label is one
    assert CAUSAL_LM.step_targets([batch, batch]) == 8 and ENCODER_DECODER.step_targets([batch]) == 5


def test_a_preference_batchs_responses_follow_the_same_shift():
    # one pair: chosen, rejected
    labels = torch.tensor([[IGNORE_INDEX, 3, 4], [IGNORE_INDEX, 5, IGNORE_INDEX]])
    batch = {"input_ids": torch.zeros_like(labels), "labels": labels}
    causal, t5 = CAUSAL_LM.responses(batch), ENCODER_DECODER.responses(batch)
    assert (causal.pairs, causal.chosen_tokens, causal.counts.tolist()) == (1, 2, [2, 1])
    assert (t5.pairs, t5.chosen_tokens, t5.counts.tolist()) == (1, 2, [2, 1])
    # position t predicts t+1
    assert causal.targets.tolist() == [3, 4, 5] and causal.index.tolist() == [0, 1, 3]
    assert t5.targets.tolist() == [3, 4, 5] and t5.index.tolist() == [1, 2, 4]


def test_generation_inputs_and_the_reply_are_the_layouts():
    tok = make_tokenizer()
    text = "def f(x): return x"
    assert (
        CAUSAL_LM.prompt_ids(tok, text, templated=False) == tok(text, add_special_tokens=False)["input_ids"]
    )
    source = ENCODER_DECODER.prompt_ids(tok, text, templated=False)
    # span corruption's sources
    assert source[-1] == tok.eos_token_id and source[:-1] == tok(text)["input_ids"]
    # the template ends it
    assert ENCODER_DECODER.prompt_ids(tok, text, templated=True) == tok(text)["input_ids"]
    assert CAUSAL_LM.new_tokens(100, 64, 10) == 54 and ENCODER_DECODER.new_tokens(100, 64, 10) == 64
    assert CAUSAL_LM.reply_start(10) == 10 and ENCODER_DECODER.reply_start(10) == 1


def test_the_layout_picks_its_own_collators_and_says_whether_it_packs():
    assert (padded(CAUSAL_LM), padded(ENCODER_DECODER)) == (PadCollator, Seq2SeqCollator)
    assert (padded_pairs(CAUSAL_LM), padded_pairs(ENCODER_DECODER)) == (PairCollator, Seq2SeqPairCollator)
    assert CAUSAL_LM.packs and not ENCODER_DECODER.packs


def test_the_layout_counts_a_batchs_tokens_and_gives_the_lengths_flops_and_the_estimate_read():
    ids = torch.zeros(2, 6, dtype=torch.long)
    labels = torch.tensor([[1, 2, IGNORE_INDEX], [3, IGNORE_INDEX, IGNORE_INDEX]])
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    packed = {"input_ids": ids, "n_real_tokens": 9, "n_padded_tokens": 12}
    assert CAUSAL_LM.batch_tokens(packed) == (9, 12)
    assert CAUSAL_LM.batch_tokens({"input_ids": ids}) == (12, 12)
    # an encoder-decoder: source (attention_mask) + target (labels not -100), real and padded
    seq2seq = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    assert ENCODER_DECODER.batch_tokens(seq2seq) == (13, 18)
    # T5 pretraining's target is span corruption's (512 -> 114); SFT's bound is MAX_LENGTH for both
    assert ENCODER_DECODER.bound_shape("pretrain", 512) == {"max_length": 512, "target_length": 114}
    assert ENCODER_DECODER.bound_shape("sft", 64) == {"max_length": 64, "target_length": 64}
    assert CAUSAL_LM.bound_shape("pretrain", 512) == {"max_length": 512}
    assert CAUSAL_LM.flop_lengths("sft", 64, rows=4, tokens=90) == (22, None)  # the real tokens per row seen
    assert CAUSAL_LM.flop_lengths("sft", 64, rows=0, tokens=0) == (64, None)
    assert ENCODER_DECODER.flop_lengths("pretrain", 512, rows=4, tokens=90) == (512, 114)
    lengths, sources = np.array([9, 30, 12]), np.array([4, 10, 2])

    def by_eight(n):
        return -(-int(n) // 8) * 8

    assert ENCODER_DECODER.data_shape(lengths, sources, by_eight) == {"max_length": 16, "target_length": 24}
    assert CAUSAL_LM.data_shape(lengths, sources, by_eight) == {"max_length": 32}
    assert ENCODER_DECODER.data_shape(lengths, None, by_eight) == {"max_length": 32}


def test_the_layout_owns_its_refusals_and_its_model_kind_decision():

    for asked in (None, 0, False):
        ENCODER_DECODER.refuse_packing(asked, "never said")
        ENCODER_DECODER.causal_only(asked, "never said")
    CAUSAL_LM.refuse_packing(1, "never said")
    CAUSAL_LM.causal_only(True, "never said")
    with pytest.raises(UsageError, match="^PACKING=1: why$"):
        ENCODER_DECODER.refuse_packing(1, "PACKING=1: why")
    with pytest.raises(UsageError, match="^LOSS_ON=all: why$"):
        ENCODER_DECODER.causal_only(True, "LOSS_ON=all: why")
    decided = []
    CAUSAL_LM.decide_kind(lambda *a: decided.append(a), "a causal LM is every mode's default: not said")
    ENCODER_DECODER.decide_kind(lambda *a: decided.append(a), "source -> target")
    assert decided == [("model_kind", "seq2seq", "source -> target")]
    assert CAUSAL_LM.fills("sft") and CAUSAL_LM.fills("dpo") and not CAUSAL_LM.fills("pretrain")
    assert ENCODER_DECODER.fills("pretrain")
