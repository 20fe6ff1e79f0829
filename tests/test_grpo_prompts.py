"""Reward training's prompts (train/data/prompt): TRL's prompt-only records (a string, or messages),
LLaMA-Factory's and MiniMind's records cut to their prompt, every reader the kit has (a .json list,
JSONL(.gz), parquet, Arrow), extra columns handed to the rewards, bad records one line each
(SKIP_BAD_RECORDS=1 skips and counts), the built-in arithmetic task made the same way from a seed,
and prompts rendered with the chat template as SFT frames a prompt (the generation prompt appended)."""

from __future__ import annotations

import gzip
import json

import pytest
from test_sft_data import make_tokenizer

from data_tools import write_arrow_folder, write_parquet
from train.core.errors import UsageError
from train.data.chat.encode import ensure_special_tokens, render
from train.data.prompt.arithmetic import QUESTION, arithmetic_prompts, problems
from train.data.prompt.prompt_formats import load_prompts
from train.data.prompt.prompts import encode_prompts, prompt_set, render_prompt

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # fmt: skip
SKY = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What color is the sky?"}]


@pytest.fixture(scope="module")
def tok():
    tokenizer = make_tokenizer()
    ensure_special_tokens(tokenizer)
    return tokenizer


def write(tmp_path, records, name="prompts.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


def one_line(err) -> str:
    assert "\n" not in str(err.value) and isinstance(err.value, UsageError)
    return str(err.value)


def test_trl_prompt_strings_keep_their_extra_columns_and_drop_completion(tmp_path):
    records = [{"prompt": "What is 2 + 2?", "answer": "4", "id": 7, "completion": "4"},
               {"prompt": "Name a color.", "answer": None, "id": 8}]  # fmt: skip
    prompts, fmt, skipped = load_prompts(write(tmp_path, records))
    assert (fmt, skipped) == ("prompt", 0)
    assert prompts[0].prompt == "What is 2 + 2?" and prompts[0].turns == [
        {"role": "user", "content": "What is 2 + 2?"}
    ]
    assert prompts[0].columns == {
        "answer": "4",
        "id": 7,
    }  # TRL leaves "completion" out of a reward's arguments
    assert prompts[1].columns == {"answer": None, "id": 8}
    assert prompts[0].place.endswith("prompts.jsonl line 1")


def test_trl_conversational_prompts_stay_messages_for_the_rewards(tmp_path):
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
    prompts, fmt, _ = load_prompts(write(tmp_path, [{"prompt": SKY, "tools": tools, "solution": "blue"}]))
    assert fmt == "prompt"
    assert prompts[0].prompt == SKY  # what TRL hands a reward: the messages
    assert prompts[0].turns == [{"role": "tools", "tools": tools}, *SKY]  # what the template renders
    assert prompts[0].columns == {"solution": "blue"}
    # a string prompt with a tools list: still a string for the rewards, the tools rendered with it
    plain = load_prompts(write(tmp_path, [{"prompt": "Weather?", "tools": tools}], "plain.jsonl"))[0][0]
    assert plain.prompt == "Weather?" and plain.turns == [
        {"role": "tools", "tools": tools},
        {"role": "user", "content": "Weather?"},
    ]


def test_a_conversation_loses_its_trailing_reply_which_becomes_the_answer(tmp_path):
    reply = {"role": "assistant", "content": "Blue."}
    records = [{"messages": [*SKY, reply]}, {"messages": SKY, "answer": "blue"},
               {"messages": [*SKY, reply], "answer": "azure"}]  # fmt: skip
    prompts, fmt, _ = load_prompts(write(tmp_path, records))
    assert fmt == "messages"
    assert [p.prompt for p in prompts] == [SKY] * 3
    assert [p.columns for p in prompts] == [{"answer": "Blue."}, {"answer": "blue"}, {"answer": "azure"}]


def test_sharegpt_and_minimind_conversations(tmp_path):
    sharegpt = {
        "conversations": [
            {"from": "human", "value": "Hi"},
            {"from": "gpt", "value": "Hello"},
            {"from": "human", "value": "2 + 3?"},
        ],
        "system": "Be brief.",
        "answer": "5",
    }
    # MiniMind's rlaif-mini.jsonl: role/content under "conversations", a placeholder reply ("空") last
    minimind = {
        "conversations": [{"role": "user", "content": "你好"}, {"role": "assistant", "content": "空"}]
    }
    prompts, fmt, _ = load_prompts(write(tmp_path, [sharegpt, minimind]))
    assert fmt == "conversations"
    assert prompts[0].prompt == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "2 + 3?"},
    ]
    assert prompts[0].columns == {"answer": "5"}
    assert prompts[1].prompt == [{"role": "user", "content": "你好"}] and prompts[1].columns == {
        "answer": "空"
    }


def test_alpaca_records_are_their_sft_prompt(tmp_path):
    record = {
        "instruction": "Add the numbers.",
        "input": "2 and 3",
        "output": "5",
        "system": "Be exact.",
        "level": 1,
    }
    prompts, fmt, _ = load_prompts(write(tmp_path, [record]))
    assert fmt == "alpaca"
    assert prompts[0].prompt == [
        {"role": "system", "content": "Be exact."},
        {"role": "user", "content": "Add the numbers.\n2 and 3"},
    ]
    assert prompts[0].columns == {"output": "5", "level": 1, "answer": "5"}


def test_every_reader_gives_the_same_prompts(tmp_path):
    rows = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(5)]
    jsonl = write(tmp_path, rows)
    (tmp_path / "p.json").write_text(json.dumps(rows))
    with gzip.open(tmp_path / "p.jsonl.gz", "wt") as f:
        f.write(jsonl.read_text())
    paths = [
        jsonl,
        tmp_path / "p.json",
        tmp_path / "p.jsonl.gz",
        write_parquet(tmp_path / "p.parquet", rows, 2),
        write_arrow_folder(tmp_path / "arrow", rows, 2),
    ]
    seen = [[(p.prompt, p.columns) for p in load_prompts(path)[0]] for path in paths]
    assert (
        all(s == seen[0] for s in seen)
        and len(seen[0]) == 5
        and seen[0][4] == ("What is 4 + 1?", {"answer": "5"})
    )


@pytest.mark.parametrize(
    "record, reason",
    [
        ({"prompt": ""}, "'prompt' is empty"),
        (
            {"prompt": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
            "'prompt' ends with an assistant turn",
        ),
        ({"prompt": [{"role": "system", "content": "Be brief."}]}, "no prompt ('prompt' has no user turn"),
        (
            {"prompt": "Hi", "completions": ["a"]},
            "has a column 'completions', the name of an argument every reward gets",
        ),
        ({"prompt": 7}, "'prompt' is int, expected a string"),
        (
            {"messages": [{"role": "assistant", "content": "Hello"}]},
            "no prompt ('messages' has no turn before the reply)",
        ),
        ({"instruction": "x"}, "does not match the file's format prompt"),
    ],
)
def test_a_bad_record_is_one_line_naming_the_file_and_line_or_skipped_and_counted(
    tmp_path, tok, record, reason
):
    good = {"messages": SKY} if "messages" in record else {"prompt": "Good one.", "answer": "1"}
    path = write(tmp_path, [good, record])
    with pytest.raises(UsageError) as err:
        load_prompts(path)
    assert f"DATA_PATH: {path} line 2: " in one_line(err) and reason in str(err.value)
    assert "(SKIP_BAD_RECORDS=1 skips such records)" in str(err.value)
    said = []
    kept = prompt_set(path, tok, skip_bad_records=True, say=said.append)
    assert len(kept) == 1 and kept.n_skipped == 1 and reason in kept.first_error
    assert said[1].startswith("skipped 1 bad record(s) (SKIP_BAD_RECORDS=1)")


def test_all_bad_or_unknown_or_empty_data_stops(tmp_path, tok):
    with pytest.raises(UsageError) as err:
        prompt_set(write(tmp_path, [{"prompt": ""}, {"prompt": ""}]), tok, skip_bad_records=True)
    assert "all 2 records are bad; the first: " in one_line(err)
    with pytest.raises(UsageError) as err:
        load_prompts(write(tmp_path, [{"question": "Hi"}]))
    assert "unknown prompt format (keys: question); accepted: prompt (" in one_line(err)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(UsageError) as err:
        load_prompts(tmp_path / "empty.jsonl")
    assert "no records (the file is empty)" in one_line(err)


def test_the_built_in_task_is_the_same_from_the_same_seed():
    first, again, other = arithmetic_prompts(0), arithmetic_prompts(0), arithmetic_prompts(1)
    assert first == again and first != other and len(first) == len(problems()) == 155
    assert sorted(p.prompt for p in first) == sorted(p.prompt for p in other)  # the same problems, reordered
    assert len({p.prompt for p in first}) == 155
    for p in first:  # each answer is its question's, and a string as a dataset would carry it
        a, op, b = p.prompt.split("?")[0].removeprefix("What is ").split()
        assert p.columns == {"answer": str(int(a) + int(b) if op == "+" else int(a) - int(b))}
        assert p.turns == [{"role": "user", "content": p.prompt}] and int(p.columns["answer"]) >= 0
    assert QUESTION.format(a=3, op="+", b=4) == "What is 3 + 4? Answer with a number."
    assert arithmetic_prompts(0, limit=5) == first[:5]


def test_prompts_render_as_sft_frames_a_prompt(tok):
    # the built-in template: the conversation's own text, then the reply marker; SFT's render of the
    # same conversation with a reply starts with exactly this text
    text = render_prompt(tok, SKY)
    assert text == "<|system|>\nBe brief.<|end|>\n<|user|>\nWhat color is the sky?<|end|>\n<|assistant|>\n"
    full = "".join(t for t, _ in render(tok, [*SKY, {"role": "assistant", "content": "Blue."}]))
    assert full.startswith(text)
    # the tokenizer's own template: apply_chat_template's generation prompt
    own = make_tokenizer()
    own.chat_template = CHATML
    assert render_prompt(own, SKY) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat color is the sky?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # no template at all (a pretraining run's model): the text, continued as generate continues it
    assert render_prompt(make_tokenizer(), SKY) == "Be brief.\nWhat color is the sky?"


def test_the_prompt_set_encodes_the_ids_and_lays_out_the_columns_for_the_rewards(tmp_path, tok):
    said = []
    built_in = prompt_set(None, tok, seed=3, say=said.append)
    assert said == [
        "prompt data: built-in, built-in arithmetic (a + b and a - b of the digits 0-9, 155 problems; "
        "the answer a number), 155 prompts"
    ]
    assert built_in.prompts == arithmetic_prompts(3)
    assert tok.decode(built_in.ids[0]) == render_prompt(tok, built_in.prompts[0].turns)
    path = write(tmp_path, [{"prompt": "A?", "answer": "1"}, {"prompt": "B?", "topic": "b"}])
    data = prompt_set(path, tok, say=said.append)
    assert data.format == "format prompt" and data.column_names == ["answer", "topic"]
    prompts, columns = data.for_rewards([1, 0], repeat=2)  # a prompt's completions are consecutive
    assert prompts == ["B?", "B?", "A?", "A?"]
    assert columns == {"answer": [None, None, "1", "1"], "topic": ["b", "b", None, None]}


def test_a_prompt_too_long_or_unrenderable_is_a_bad_record(tmp_path, tok):
    path = write(tmp_path, [{"prompt": "Short?"}, {"prompt": "A much longer prompt than the others " * 4}])
    with pytest.raises(UsageError) as err:
        prompt_set(path, tok, max_tokens=40)
    assert f"DATA_PATH: {path} line 2: is " in one_line(
        err
    ) and "tokens with the chat template; at most 40 fit" in str(err.value)
    assert len(prompt_set(path, tok, max_tokens=40, skip_bad_records=True, say=lambda _: None)) == 1
    broken = make_tokenizer()
    broken.chat_template = "{{ raise_exception('no system turns') }}"
    ids, bad = encode_prompts(load_prompts(path)[0], broken)
    assert ids == [None, None] and "cannot be rendered by the chat template: no system turns" in bad[0]
