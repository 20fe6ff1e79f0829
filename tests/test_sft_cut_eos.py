"""A reply cut by MAX_LENGTH still ends: its end-of-turn token (the built-in <|end|>, eos under
TEMPLATE=none, an encoder-decoder target's eos) takes the last place, as ChatLM keeps [EOS] on a
cut response; a window that ends outside a reply is cut as before. The TEMPLATE table's names are
the ones config.py accepts."""

import pytest
from test_sft_data import make_tokenizer, trained_runs

import config
from train.core.errors import UsageError
from train.core.units import IGNORE_INDEX
from train.data.chat.encode import Rendering, encode_conversations, encode_pairs, ensure_special_tokens
from train.data.chat.template_table import NAMES, TEMPLATE
from train.data.chat.templates import END_TOKEN, cut_conversation, fit_pair

LONG = [{"role": "user", "content": "Say hello."},
        {"role": "assistant", "content": "Hello world. " * 20}]  # fmt: skip


@pytest.fixture(scope="module")
def tok():
    tokenizer = make_tokenizer()
    ensure_special_tokens(tokenizer)
    return tokenizer


@pytest.mark.parametrize("template", ["builtin", "none"])
def test_a_cut_causal_reply_keeps_its_end_of_turn(tok, template):
    rendering = Rendering(template=template)
    (whole,), _ = encode_conversations([LONG], tok, 10_000, rendering)
    (cut,), n_cut = encode_conversations([LONG], tok, 24, rendering)
    end = tok.convert_tokens_to_ids(END_TOKEN) if template == "builtin" else tok.eos_token_id
    assert n_cut == 1 and len(cut["input_ids"]) == 24
    assert cut["input_ids"][-1] == cut["labels"][-1] == end  # the reply's end, trained
    assert cut["input_ids"][:23] == whole["input_ids"][:23]  # the rest as a plain cut keeps it
    assert trained_runs(cut)[0][-1] == end and whole["input_ids"][23] != end


def test_cut_conversation_closes_only_a_trained_run_that_ends_in_an_end_token():
    ids = [5, 6, 7, 8, 9, 2, 10, 11]
    labels = [IGNORE_INDEX, IGNORE_INDEX, 7, 8, 9, 2, IGNORE_INDEX, IGNORE_INDEX]
    assert cut_conversation(ids, labels, 0, 4, "keep_end", ends={2}) == ([5, 6, 7, 2], labels[:3] + [2])
    # no end known: a plain cut
    assert cut_conversation(ids, labels, 0, 4, "keep_end") == (ids[:4], labels[:4])
    # outside a reply
    assert cut_conversation(ids, labels, 0, 7, "keep_end", ends={2}) == (ids[:7], labels[:7])
    # the source cut (the reply starts past the window) keeps the reply's end too
    kept = cut_conversation(
        [1, 1, 1, 1, 1, 7, 8, 9, 2], [IGNORE_INDEX] * 5 + [7, 8, 9, 2], 0, 6, "keep_end", 1, {2}
    )
    assert kept[0][-1] == kept[1][-1] == 2 and len(kept[0]) == 6


def test_a_cut_seq2seq_target_keeps_its_eos(tok):
    source, target = [3, 4], [7, 8, 9, 10, 2]
    assert fit_pair(source, 0, target, ([], []), 3, "keep_start") == ([3, 4], [7, 8, 2], True)
    assert fit_pair(source, 0, target, ([], []), 5, "keep_start") == ([3, 4], target, False)
    (pair,), n_cut = encode_pairs([LONG], tok, 16, Rendering(template="none"))
    assert n_cut == 1 and len(pair["labels"]) == 16 and pair["labels"][-1] == tok.eos_token_id


def test_the_template_table_names_are_what_config_accepts(tmp_path):
    assert set(TEMPLATE) == {*NAMES, "file"}
    for name in NAMES:
        assert config.DataConfig(template=name).template == name
    with pytest.raises(UsageError, match="builtin | tokenizer | none"):
        config.DataConfig(template=str(tmp_path / "no.jinja"))
