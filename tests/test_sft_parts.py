"""Typed content parts: OpenAI's {"type": "text", "text"} parts, LLaMA-Factory v1's {"type": "text" |
"reasoning" | "tool_call", "value"} parts with a per-message loss_weight and a tools field, OpenAI-style
reasoning keys and plain-text records become the one conversation shape, turn by turn; parts a text
model cannot use are refused in one line, or skipped and counted with SKIP_BAD_RECORDS=1."""

from __future__ import annotations

import json
import re

import pytest
from test_bad_records import (
    refused,
    train_here,
    world,  # noqa: F401  (a fixture: runs folder, flags)
)
from test_sft_data import write_jsonl

from train.core.errors import UsageError
from train.data.chat.formats import load_conversations, open_records, to_conversation

# The shapes of LLaMA-Factory's own demo files (data/v1_sft_demo.jsonl, data/reason_tool_use_demo_50.jsonl),
# written here by hand with short texts: before typed parts, both stopped at line 1 with "no response
# (assistant turn 2 is empty)".
V1_SFT = {
    "messages": [
        {"role": "user", "content": [{"type": "text", "value": "hi"}], "loss_weight": 0.0},
        {
            "role": "assistant",
            "content": [{"type": "text", "value": "Hello! I am {{name}}."}],
            "loss_weight": 1.0,
        },
    ]
}
V1_MULTI = {"messages": [
    {"role": "user", "content": [{"type": "text", "value": "Who are you?"}], "loss_weight": 0.0},
    {"role": "assistant", "content": [{"type": "text", "value": "An old answer."}], "loss_weight": 0.0},
    {"role": "user", "content": [{"type": "text", "value": "Again?"}], "loss_weight": 0.0},
    {"role": "assistant", "content": [{"type": "text", "value": "A new answer."}], "loss_weight": 1.0},
    {"role": "user", "content": [{"type": "text", "value": "Thanks"}], "loss_weight": 0.0},
    {"role": "assistant", "content": [{"type": "text", "value": "Not trained."}], "loss_weight": 0},
]}  # fmt: skip
SCHEMA = {
    "type": "function",
    "function": {
        "name": "circle_area",
        "description": "Area of a circle.",
        "parameters": {
            "type": "object",
            "properties": {"radius": {"type": "number"}},
            "required": ["radius"],
        },
    },
}
REASON_TOOL = {
    "messages": [
        {"role": "system", "content": [{"type": "text", "value": "Reason before you answer."}]},
        {"role": "user", "content": [{"type": "text", "value": "Areas for radius 1.5 and 3?"}]},
        {"role": "assistant", "content": [
            {"type": "reasoning", "value": "Two radii: call circle_area twice."},
            {"type": "tool_call", "value": '{"name": "circle_area", "arguments": {"radius": 1.5}}'},
            {"type": "tool_call", "value": '{"name": "circle_area", "arguments": {"radius": 3}}'},
        ]},
        {"role": "tool", "content": [{"type": "text", "value": '[{"area": 7.07}, {"area": 28.27}]'}]},
        {"role": "assistant", "content": [
            {"type": "reasoning", "value": "Both results are in."},
            {"type": "text", "value": "7.07 and 28.27 square meters."},
        ]},
    ],
    "tools": json.dumps([SCHEMA]),
}  # fmt: skip
OPENAI_PARTS = {
    "messages": [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Add 2 "}, {"type": "text", "text": "and 3."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "5"}]},
    ]
}
IMAGE = {"messages": [
    {"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                 {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]},
    {"role": "assistant", "content": "A cat."},
]}  # fmt: skip


def call(radius):
    return {"type": "function", "function": {"name": "circle_area", "arguments": {"radius": radius}}}


def jsonl(path, records):
    write_jsonl(path, records)
    return path


def loaded(tmp_path, *records, **kw):
    return load_conversations(jsonl(tmp_path / "d.jsonl", list(records)), **kw)


def test_openai_multi_part_record_is_its_joined_text(tmp_path):
    conversations, fmt, skipped = loaded(tmp_path, OPENAI_PARTS)
    assert (fmt, skipped) == ("messages", 0)
    assert conversations == [[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Add 2 and 3."},
        {"role": "assistant", "content": "5"},
    ]]  # fmt: skip


def test_v1_records_keep_their_loss_weights(tmp_path):
    conversations, fmt, skipped = loaded(tmp_path, V1_SFT, V1_MULTI)
    assert (fmt, skipped) == ("messages", 0)
    assert conversations[0] == [
        {"role": "user", "content": "hi", "loss_weight": 0.0},
        {"role": "assistant", "content": "Hello! I am {{name}}.", "loss_weight": 1.0},
    ]
    # Weight 0 on the first reply: kept as context, marked untrained; the trailing turns the loss
    # skips (a user turn, a reply of weight 0) are dropped.
    assert conversations[1] == [
        {"role": "user", "content": "Who are you?", "loss_weight": 0.0},
        {"role": "assistant", "content": "An old answer.", "loss_weight": 0.0},
        {"role": "user", "content": "Again?", "loss_weight": 0.0},
        {"role": "assistant", "content": "A new answer.", "loss_weight": 1.0},
    ]
    assert all(type(t["loss_weight"]) is float for c in conversations for t in c)


def test_reasoning_and_tool_call_parts(tmp_path):
    (conversation,), fmt, _ = loaded(tmp_path, REASON_TOOL)
    assert fmt == "messages"
    assert conversation == [
        {"role": "tools", "tools": [SCHEMA]},
        {"role": "system", "content": "Reason before you answer."},
        {"role": "user", "content": "Areas for radius 1.5 and 3?"},
        {"role": "assistant", "content": "", "reasoning_content": "Two radii: call circle_area twice.",
         "tool_calls": [call(1.5), call(3)]},
        {"role": "tool", "content": '[{"area": 7.07}, {"area": 28.27}]'},
        {"role": "assistant", "content": "7.07 and 28.27 square meters.", "reasoning_content": "Both results "
                                                                                               "are in."},
    ]  # fmt: skip


def test_parquet_parts_read_as_jsonl(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    # One struct type per column: there every part carries every key ("text": None beside "value").
    records = [REASON_TOOL, OPENAI_PARTS, V1_MULTI]
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "d.parquet")
    assert load_conversations(tmp_path / "d.parquet") == loaded(tmp_path, *records)


@pytest.mark.parametrize("key", ["reasoning_content", "reasoning", "thinking"])
def test_openai_style_reasoning_keys(key):
    record = {
        "messages": [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "5", key: "Add."}]
    }
    assert to_conversation(record, "messages")[1] == {
        "role": "assistant",
        "content": "5",
        "reasoning_content": "Add.",
    }
    # A trace alone is a reply (the thinking is trained), not an empty turn.
    record["messages"][1]["content"] = ""
    assert to_conversation(record, "messages")[1]["reasoning_content"] == "Add."


def test_plain_text_records_and_text_field(tmp_path):
    conversations, fmt, _ = loaded(tmp_path, {"text": "One whole document.", "id": 1}, {"text": "Another."})
    assert fmt == "text"
    assert conversations == [
        [{"role": "text", "content": "One whole document."}],
        [{"role": "text", "content": "Another."}],
    ]
    both = {"text": "the text field", "body": "the body field"}
    conversations, fmt, _ = loaded(tmp_path, both, text_field="body")
    assert (fmt, conversations) == ("text:body", [[{"role": "text", "content": "the body field"}]])
    assert open_records(tmp_path / "d.jsonl", "body")[0] == "text:body"
    # Turns win over a stray text field; a text record among conversations is a bad record.
    assert loaded(tmp_path, {**OPENAI_PARTS, "text": "x"})[1] == "messages"
    with pytest.raises(UsageError, match=r"line 2: does not match the file's format messages"):
        loaded(tmp_path, OPENAI_PARTS, {"text": "x"})
    with pytest.raises(UsageError, match=r"line 1: 'text' \(TEXT_FIELD\) is empty"):
        loaded(tmp_path, {"text": "  "}, {"text": "fine"})
    with pytest.raises(UsageError, match=r"unknown SFT format .*text \(body = TEXT_FIELD"):
        loaded(tmp_path, {"question": "x"}, text_field="body")


def turn2(content, **extra):
    return {
        "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": content, **extra}]
    }


WRONG = {
    "empty text parts": (
        turn2([{"type": "text", "value": " "}, {"type": "text", "text": ""}]),
        "no response (assistant turn 2 is empty: its 2 content part(s), of type text, hold no text)",
    ),
    "no parts": (turn2([]), "no response (assistant turn 2 is empty: its content is an empty list of parts)"),
    "unknown type": (
        turn2([{"type": "summary", "value": "x"}]),
        "turn 2 content part 1 has type 'summary'; read: text",
    ),
    "no value": (
        turn2([{"type": "reasoning"}]),
        "turn 2 content part 1 (reasoning) has no 'reasoning' or 'value'",
    ),
    "user reasoning": (
        {
            "messages": [
                {"role": "user", "content": [{"type": "reasoning", "value": "hm"}]},
                {"role": "assistant", "content": "a"},
            ]
        },
        "turn 1 (user) has reasoning parts; only an assistant turn carries them",
    ),
    "bad call": (
        turn2([{"type": "tool_call", "value": "{oops"}]),
        "turn 2 content part 1 (tool_call) is not JSON",
    ),
    "weight": (
        turn2("a", loss_weight=-1),
        "turn 2 loss_weight is -1, expected 0 (not trained) or 1 (trained)",
    ),
    "half_weight": (turn2("a", loss_weight=0.5), "turn 2 loss_weight is 0.5, expected 0 (not trained) or 1"),
    "weight 0": (turn2("a", loss_weight=0.0), "nothing to train (every assistant turn has loss_weight 0)"),
    "audio": (
        turn2([{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]),
        "turn 2 content part 1 is an audio part: this kit trains text models",
    ),
}


@pytest.mark.parametrize("label", list(WRONG))
def test_wrong_parts_say_what_was_found(tmp_path, label):
    record, expect = WRONG[label]
    with pytest.raises(UsageError, match=re.escape(f"d.jsonl line 2: {expect}")):
        loaded(tmp_path, V1_SFT, record)
    assert loaded(tmp_path, V1_SFT, record, skip_bad_records=True)[2] == 1


def test_an_image_part_is_refused_in_one_line_or_skipped(world, base_model, capsys):  # noqa: F811
    good = [
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": f"q{i}"}]},
                {"role": "assistant", "content": [{"type": "text", "text": f"a{i}"}]},
            ]
        }
        for i in range(4)
    ]
    data = jsonl(world["dir"] / "d.jsonl", [good[0], IMAGE, *good[1:]])
    sft = ["--model_path", str(base_model), "--batch_size", "2"]
    refused(world, "sft", data, f"{data} line 2: turn 1 content part 2 is an image part: this kit trains "
                                f"text models",
            "SKIP_BAD_RECORDS=1", extra=sft, here=capsys)
    result = train_here(
        capsys,
        "sft",
        *world["flags"],
        "--data_path",
        str(data),
        *sft,
        "--skip_bad_records",
        "1",
        "--run_name",
        "skip",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((world["runs"] / "skip" / "summary.json").read_text())
    assert (summary["n_skipped"], summary["n_conversations"]) == (1, 4)
    assert "skipped 1 bad record(s)" in result.stdout and "is an image part" in result.stdout
