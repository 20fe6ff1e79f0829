"""From a record as users have it to the tokens the loss counts, end to end (read by sft_formats,
rendered by the built-in template): an OpenAI multi-part record, a LLaMA-Factory v1 record whose
earlier assistant turn has loss_weight 0, and a reasoning + tool_call record. Each trained span is
exact, and what is not trained is still in the input."""

from __future__ import annotations

import json

import pytest
from test_sft_data import make_tokenizer, trained_runs
from test_sft_parts import OPENAI_PARTS, REASON_TOOL, V1_MULTI

from train.data.chat.encode import encode_conversations, ensure_special_tokens
from train.data.chat.formats import load_conversations

CALL = '<|tool_call|>{{"name": "circle_area", "arguments": {{"radius": {}}}}}'


@pytest.fixture(scope="module")
def tok():
    tokenizer = make_tokenizer()
    ensure_special_tokens(tokenizer)
    return tokenizer


@pytest.mark.parametrize(
    "record, trained, untrained",
    [
        (OPENAI_PARTS, ["5<|end|>"], ["Add 2 and 3."]),
        (V1_MULTI, ["A new answer.<|end|>"], ["<|assistant|>\nAn old answer.<|end|>"]),
        (
            REASON_TOOL,
            [
                "<think>\nTwo radii: call circle_area twice.\n</think>\n"
                + CALL.format(1.5)
                + CALL.format(3)
                + "<|end|>",
                "<think>\nBoth results are in.\n</think>\n7.07 and 28.27 square meters.<|end|>",
            ],
            [
                '<|tools|>\n[{"type": "function", "function": {"name": "circle_area"',
                '<|tool|>\n[{"area": 7.07}',
            ],
        ),
    ],
    ids=["openai_parts", "v1_loss_weight_0", "reasoning_tool_call"],
)
def test_records_train_exactly_their_replies(record, trained, untrained, tok, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(record) + "\n")
    conversations, fmt, skipped = load_conversations(path)
    assert (fmt, skipped) == ("messages", 0)
    (example,), _ = encode_conversations(conversations, tok, 1024)
    assert [tok.decode(run) for run in trained_runs(example)] == trained
    text = tok.decode(example["input_ids"])
    assert all(piece in text for piece in untrained)
    assert "Not trained." not in text  # v1: a trailing turn of weight 0 only cost tokens, so it is dropped


def test_llama_factory_history_and_record_system_are_turns(tmp_path):
    """LLaMA-Factory's alpaca "history" pairs and a record-level "system" (alpaca, ShareGPT) were dropped."""
    from train.data.chat.formats import to_conversation

    alpaca = {"system": "Be kind.", "instruction": "And 3?", "input": "", "output": "Odd.",
              "history": [["Is 2 even?", "Yes."]]}  # fmt: skip
    assert [(t["role"], t["content"]) for t in to_conversation(alpaca, "alpaca")] == [
        ("system", "Be kind."),
        ("user", "Is 2 even?"),
        ("assistant", "Yes."),
        ("user", "And 3?"),
        ("assistant", "Odd."),
    ]
    share = {
        "system": "Be brief.",
        "tools": "[]",
        "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}],
    }
    assert [t["role"] for t in to_conversation(share, "sharegpt")] == ["system", "user", "assistant"]
    with pytest.raises(ValueError, match="'history' is not a list of"):
        to_conversation({**alpaca, "history": ["loose"]}, "alpaca")


def test_trl_prompt_completion_records_are_read():
    from train.data.chat.formats import detect_format, to_conversation

    plain = {"prompt": "2 + 2 =", "completion": " 4"}
    chat = {
        "prompt": [{"role": "user", "content": "2 + 2?"}],
        "completion": [{"role": "assistant", "content": "4"}],
    }
    for record in (plain, chat):
        assert detect_format(record) == "prompt_completion"
        assert [t["role"] for t in to_conversation(record, "prompt_completion")] == ["user", "assistant"]
    assert to_conversation(plain, "prompt_completion")[1]["content"] == " 4"
