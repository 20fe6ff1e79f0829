"""Tool-call SFT data: glaive (function_call / observation turns, a tools field) and OpenAI
(assistant tool_calls, role tool, a tools list) become one conversation; the loss covers the
assistant's calls and replies and nothing else, with the built-in template and with a
tokenizer's own template that takes tools; a glaive file trains end to end."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from test_sft_data import IGNORE_INDEX, ids_of, make_tokenizer, trained_runs, write_jsonl

from conftest import run_cli
from train.core.errors import UsageError
from train.data.chat.encode import (
    BUILTIN_CHAT_TEMPLATE,
    encode_conversations,
    ensure_special_tokens,
    load_conversations,
    prompt_for_generation,
    render,
)
from train.data.chat.formats import to_conversation
from train.data.chat.turns import BadRecord, split_tools
from train.tools.generate import Chat

SCHEMA = {
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
RESULT = '{"temp_c": 21}'
GLAIVE = {
    "conversations": [
        {"from": "human", "value": "Weather in Paris?"},
        {"from": "function_call", "value": CALL},
        {"from": "observation", "value": RESULT},
        {"from": "gpt", "value": "It is 21 degrees."},
    ],
    "tools": json.dumps([SCHEMA]),
}
OPENAI = {
    "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            ],
        },  # fmt: skip
        {"role": "tool", "tool_call_id": "c1", "content": RESULT},
        {"role": "assistant", "content": "It is 21 degrees."},
    ],
    "tools": [{"type": "function", "function": SCHEMA}],
}


@pytest.fixture(scope="module")
def tok():
    tokenizer = make_tokenizer()
    ensure_special_tokens(tokenizer)
    return tokenizer


def encode_one(tokenizer, conversation) -> dict:
    (example,), _ = encode_conversations([conversation], tokenizer, max_length=1024)
    # Segment-wise ids equal the ids of the whole rendered string: the model sees what inference sees.
    assert example["input_ids"] == ids_of(tokenizer, "".join(t for t, _ in render(tokenizer, conversation)))
    return example


def masked_text(tokenizer, example) -> str:
    pairs = zip(example["input_ids"], example["labels"], strict=True)
    return tokenizer.decode([token for token, label in pairs if label == IGNORE_INDEX])


def test_glaive_trains_on_the_call_and_the_reply_only(tok):
    conversation = to_conversation(GLAIVE, "sharegpt")
    example = encode_one(tok, conversation)
    assert trained_runs(example) == [
        ids_of(tok, f"<|tool_call|>{CALL}<|end|>"),
        ids_of(tok, "It is 21 degrees.<|end|>"),
    ]
    masked = masked_text(tok, example)
    tools_block = "<|tools|>\n" + json.dumps([{"type": "function", "function": SCHEMA}]) + "<|end|>\n"
    assert masked.startswith(tools_block) and f"<|tool|>\n{RESULT}<|end|>" in masked
    # final/ carries the same template as Jinja: apply_chat_template(..., tools=...) renders the same text.
    tools, turns = split_tools(conversation)
    assert tok.chat_template == BUILTIN_CHAT_TEMPLATE
    assert tok.apply_chat_template(turns, tools=tools, tokenize=False) == tok.decode(example["input_ids"])
    assert prompt_for_generation(tok, conversation[:2]) == tools_block + ("<|user|>\nWeather in "
                                                                          "Paris?<|end|>\n<|assistant|>\n")


def test_openai_trains_on_text_calls_and_reply(tok):
    conversation = to_conversation(OPENAI, "messages")
    assert conversation[4] == {"role": "tool", "content": RESULT, "tool_call_id": "c1"}
    example = encode_one(tok, conversation)
    assert trained_runs(example) == [
        ids_of(tok, f"Let me look.<|tool_call|>{CALL}<|end|>"),
        ids_of(tok, "It is 21 degrees.<|end|>"),
    ]
    tools, turns = split_tools(conversation)
    assert tok.apply_chat_template(turns, tools=tools, tokenize=False) == tok.decode(example["input_ids"])
    # The glaive spelling of the same exchange (tools a JSON string, arguments an object) is the same tokens.
    glaive = to_conversation({**GLAIVE, "tools": [SCHEMA]}, "sharegpt")
    assert split_tools(glaive)[0] == tools and glaive[2]["tool_calls"] == conversation[3]["tool_calls"]


def test_parallel_calls_are_one_trained_turn(tok):
    second = '{"name": "get_weather", "arguments": {"city": "Rome"}}'
    glaive = {**GLAIVE, "conversations": [*GLAIVE["conversations"]]}
    glaive["conversations"][1] = {"from": "function_call", "value": f"[{CALL}, {second}]"}
    calls = [json.loads(c) for c in (CALL, second)]
    openai = {**OPENAI, "messages": [*OPENAI["messages"]]}
    openai["messages"][2] = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"type": "function", "function": {**c, "arguments": json.dumps(c["arguments"])}} for c in calls
        ],
    }
    for record, fmt in ((glaive, "sharegpt"), (openai, "messages")):
        example = encode_one(tok, to_conversation(record, fmt))
        assert trained_runs(example) == [
            ids_of(tok, f"<|tool_call|>{CALL}<|tool_call|>{second}<|end|>"),
            ids_of(tok, "It is 21 degrees.<|end|>"),
        ]


OWN_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}"
    "{% for c in m['tool_calls'] or [] %}<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_own_template_with_tools_masks_the_same_spans():
    tokenizer = make_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = OWN_TEMPLATE
    assert ensure_special_tokens(tokenizer) == 0  # its own template: no kit markers
    for record, fmt, text in ((GLAIVE, "sharegpt", ""), (OPENAI, "messages", "Let me look.")):
        conversation = to_conversation(record, fmt)
        example = encode_one(tokenizer, conversation)
        assert trained_runs(example) == [
            ids_of(tokenizer, f"{text}<tool_call>{CALL}</tool_call><|im_end|>"),
            ids_of(tokenizer, "It is 21 degrees.<|im_end|>"),
        ]
        masked = masked_text(tokenizer, example)
        assert masked.startswith("<|im_start|>system\nTools: [{") and RESULT in masked
    # A template that would drop the tools (or the calls) is refused, not trained on without them.
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    )
    with pytest.raises(UsageError, match="does not render the tools list"):
        encode_conversations([to_conversation(GLAIVE, "sharegpt")], tokenizer, 1024)
    with pytest.raises(UsageError, match="does not render tool calls"):
        encode_conversations([to_conversation({**GLAIVE, "tools": ""}, "sharegpt")], tokenizer, 1024)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"tools": "[{not json"}, "'tools' is not JSON"),
        ({"tools": [{"description": "nameless"}]}, "tool 1 has no name"),
        (
            {
                "conversations": [
                    {"from": "human", "value": "x"},
                    {"from": "function_call", "value": "get it"},
                ]
            },
            r"turn 2 \(function_call\) is not JSON",
        ),
        (
            {
                "conversations": [
                    {"from": "human", "value": "x"},
                    {"from": "function_call", "value": '{"arguments": {}}'},
                ]
            },
            r"turn 2 \(function_call\) is not a call",
        ),
    ],
)
def test_bad_tool_records_say_what_is_wrong(change, match):
    with pytest.raises(BadRecord, match=match):
        to_conversation({**GLAIVE, **change}, "sharegpt")


def test_earlier_builtin_template_is_brought_up_to_date():
    tokenizer = make_tokenizer()
    tokenizer.add_special_tokens(
        {"additional_special_tokens": ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]}
    )
    tokenizer.chat_template = (  # what an SFT run's final/ carried before tool calls
        "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    # As it is (python -m train generate on such a final/), it still renders what it trained on.
    assert prompt_for_generation(tokenizer, "Hi") == "<|user|>\nHi<|end|>\n<|assistant|>\n"
    assert ensure_special_tokens(tokenizer) == 3 and tokenizer.chat_template == BUILTIN_CHAT_TEMPLATE


def test_a_tokenizer_without_a_chat_template_prompts_with_the_plain_text():
    """A pretraining run's tokenizer: no chat template, no built-in markers. Its prompt is the turns' text,
    as generate's and the reward prompts' template-less path gives it (was a RuntimeError traceback)."""
    tokenizer = make_tokenizer()
    assert tokenizer.chat_template is None
    assert prompt_for_generation(tokenizer, "Hi") == "Hi"
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert prompt_for_generation(tokenizer, turns) == "Be brief.\nHi"
    ensure_special_tokens(tokenizer)  # with the markers, the built-in template frames it as before
    assert prompt_for_generation(tokenizer, "Hi") == "<|user|>\nHi<|end|>\n<|assistant|>\n"


def test_glaive_file_trains_without_skipping_and_final_chats(base_model, tmp_path, capsys):
    records = []
    for i in range(12):
        record = json.loads(json.dumps(GLAIVE))
        record["conversations"][0]["value"] = f"Weather in city {i}?"
        # The tiny model's context is 64 tokens: a tools list that with the "reply now" marker fills
        # MAX_LENGTH is refused, not cut; so a one-letter tool here.
        record["tools"] = json.dumps([{"name": "f"}])
        records.append(record if i % 3 else {**record, "tools": [{"name": "f"}]})  # a string and a list
    # As in LLaMA-Factory's demo file: plain exchanges with "tools": "[]" among the calls.
    records[1] = {
        "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}],
        "tools": "[]",
    }
    data = tmp_path / "glaive_toolcall.jsonl"
    write_jsonl(data, records)
    conversations, fmt, skipped = load_conversations(data)
    assert (len(conversations), fmt, skipped) == (12, "sharegpt", 0)
    sft_argv = ["--model_path", str(base_model), "--output_dir", str(tmp_path / "runs"), "--max_length", "64",
                "--batch_size", "4", "--num_workers", "0", "--data_path", str(data), "--max_steps", "2",
                "--run_name", "tools"]  # fmt: skip
    assert run_cli("sft", *sft_argv) == 0
    run = tmp_path / "runs" / "tools"
    summary = json.loads((run / "summary.json").read_text())
    assert (
        summary["n_conversations"] == 12
        and summary["data_format"] == "sharegpt"
        and summary["final_loss"] > 0
    )
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(run / "final", local_files_only=True)
    tools, turns = split_tools(conversations[0])
    assert saved.apply_chat_template(turns, tools=tools, tokenize=False) == "".join(
        t for t, _ in render(saved, conversations[0])
    )
    capsys.readouterr()
    argv = [
        "--model",
        str(run / "final"),
        "--prompt",
        "Weather?",
        "--temperature",
        "0",
        "--max_new_tokens",
        "4",
    ]
    assert run_cli("generate", *argv) == 0
    assert capsys.readouterr().err == ""
    (tmp_path / "tools.json").write_text(json.dumps([{"name": "f"}]))  # the tiny model has a context of 64
    argv[3] = "Hi"
    assert run_cli("generate", *argv, "--tools", str(tmp_path / "tools.json")) == 0
    assert run_cli("generate", *argv, "--tools", "[{oops") == 2
    assert capsys.readouterr().err.strip().splitlines() == ["error: --tools: 'tools' is not JSON: '[{oops'"]
    # A call that is not JSON stops the run in one line naming the file, line and turn.
    records[4]["conversations"][1]["value"] = "get_weather(Paris)"
    write_jsonl(data, records)
    assert run_cli("sft", *[a if a != "tools" else "bad" for a in sft_argv]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: ") and f"{data} line 5: turn 2 (function_call) is not JSON" in line
    assert not (tmp_path / "runs" / "bad").exists()


def test_chat_reply_keeps_the_call_marker(tok):
    """A reply that is a call shows as one (the marker kept, other markup dropped), and a chat
    turn holding it renders back to the ids the model made."""
    reply = ids_of(tok, f"Let me look.<|tool_call|>{CALL}<|end|>")
    chat = SimpleNamespace(tok=tok, templated=True)
    text = Chat._decode(chat, reply)
    assert text == f"Let me look.<|tool_call|>{CALL}"
    assert ids_of(tok, text + "<|end|>") == reply
