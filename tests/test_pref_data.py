"""Preference data (train/data/pref): every shape users have read into the same pairs (LLaMA-Factory's
sharegpt, alpaca and v1 records, TRL's four documented shapes, MiniMind's dpo.jsonl, ChatLM's raw strings),
the pairs tokenized through SFT's own templates (the chosen row is SFT's conversation, the prompt
untrained), truncation that cuts the prompt once for both sides and counts a cut reply, and each bad
record as one line naming the file and the line (SKIP_BAD_RECORDS=1 skips and counts)."""

from __future__ import annotations

import json

import pytest
from test_sft_data import make_tokenizer

from train.core.errors import UsageError
from train.core.units import IGNORE_INDEX
from train.data.chat.encode import encode_conversations, encode_pairs, ensure_special_tokens
from train.data.chat.pair_encode import encode
from train.data.chat.pair_formats import load_pairs
from train.data.chat.templates import Rendering, Tally
from train.models.family import CAUSAL_LM, ENCODER_DECODER

SKY = {"prompt": [{"role": "user", "content": "What color is the sky?"}],
       "chosen": [{"role": "assistant", "content": "It is blue."}],
       "rejected": [{"role": "assistant", "content": "It is green."}]}  # fmt: skip


@pytest.fixture(scope="module")
def tok():
    tokenizer = make_tokenizer()
    ensure_special_tokens(tokenizer)
    return tokenizer


def write(tmp_path, records, name="pairs.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


def read(tmp_path, records, **kw):
    pairs, fmt, skipped = load_pairs(write(tmp_path, records), **kw)
    return pairs, fmt


def test_llamafactory_sharegpt_records_their_own_demo(tmp_path):
    # The shape of LLaMA-Factory's data/dpo_en_demo.json and dpo_zh_demo.json (records 2 of each, the
    # texts abridged): conversations (system, human) and one gpt message per side.
    en = {"conversations": [
        {"from": "system", "value": "You are a teacher. Given a task, you explain in simple steps what the "
                                    "task is asking."},
        {"from": "human", "value": "Q: In this task, you need to provide the parts-of-speech tag of a "
                                   "word.\nA:"}],
        "chosen": {"from": "gpt", "value": "In this task, you are asked to identify the part-of-speech (POS) "
                                           "tag."},
        "rejected": {"from": "gpt", "value": "Sure, I'd be happy to help! Here are the steps to find the "
                                             "part of speech."}}
    zh = {"conversations": [{"from": "human", "value": "请提供一下对香港银行业的分析以及目前面临的挑战。"}],
          "chosen": {"from": "gpt", "value": "香港银行业长期以来一直是该城市"
                                                "金融服务业和整体经济的重要组成部分。"},
          "rejected": {"from": "gpt", "value": "香港的银行业面临着诸多挑战，"
                                                  "如低利率、高房价和经济疲软。"}}  # fmt: skip
    pairs, fmt = read(tmp_path, [en, zh])
    assert fmt == "sharegpt"
    assert pairs[0] == {
        "prompt": [{"role": "system", "content": en["conversations"][0]["value"]},
                   {"role": "user", "content": en["conversations"][1]["value"]}],
        "chosen": [{"role": "assistant", "content": en["chosen"]["value"]}],
        "rejected": [{"role": "assistant", "content": en["rejected"]["value"]}]}  # fmt: skip
    asked = "请提供一下对香港银行业的分析以及目前面临的挑战。"
    assert pairs[1]["prompt"] == [{"role": "user", "content": asked}]
    assert pairs[1]["rejected"][0]["content"].startswith("香港的银行业")


def test_llamafactory_alpaca_record_of_their_readme(tmp_path):
    record = {"instruction": "human instruction (required)", "input": "human input (optional)",
              "chosen": "chosen answer (required)", "rejected": "rejected answer (required)"}  # fmt: skip
    with_history = {**record, "system": "Be brief.", "history": [["Hi", "Hello!"]]}
    pairs, fmt = read(tmp_path, [record, with_history])
    assert fmt == "alpaca"
    user = {"role": "user", "content": "human instruction (required)\nhuman input (optional)"}
    assert pairs[0] == {
        "prompt": [user],
        "chosen": [{"role": "assistant", "content": "chosen answer (required)"}],
        "rejected": [{"role": "assistant", "content": "rejected answer (required)"}],
    }
    assert pairs[1]["prompt"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        user,
    ]


def test_llamafactory_v1_messages_with_typed_parts_and_loss_weight(tmp_path, tok):
    # LLaMA-Factory v1's DPOSample: chosen_messages / rejected_messages, whole conversations of typed
    # parts, a loss_weight each (0 on the system and user turns, as its converters write them).
    def side(answer):
        return [
            {"role": "system", "content": [{"type": "text", "value": "Be brief."}], "loss_weight": 0.0},
            {
                "role": "user",
                "content": [{"type": "text", "value": "What color is the sky?"}],
                "loss_weight": 0.0,
            },
            {"role": "assistant", "content": [{"type": "text", "value": answer}], "loss_weight": 1.0},
        ]

    pairs, fmt = read(
        tmp_path, [{"chosen_messages": side("It is blue."), "rejected_messages": side("It is green.")}]
    )
    assert fmt == "chosen_messages"
    system = {"role": "system", "content": "Be brief.", "loss_weight": 0.0}
    assert pairs == [{"prompt": [system, {**SKY["prompt"][0], "loss_weight": 0.0}],
                      "chosen": [{**SKY["chosen"][0], "loss_weight": 1.0}],
                      "rejected": [{**SKY["rejected"][0], "loss_weight": 1.0}]}]  # fmt: skip
    (example,), _, _ = encode(pairs, tok, 64)
    assert tok.decode(example["prompt_ids"]) == ("<|system|>\nBe brief.<|end|>\n<|user|>\nWhat color is the "
                                                 "sky?<|end|>\n<|assistant|>\n")
    trained = [
        i
        for i, label in zip(example["chosen_ids"], example["chosen_labels"], strict=True)
        if label != IGNORE_INDEX
    ]
    assert tok.decode(trained) == "It is blue.<|end|>"


def test_trl_documented_shapes_read_into_the_same_pairs(tmp_path):
    """TRL's dataset-formats page: preference, standard and conversational, explicit and implicit prompt."""
    standard = [{"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
                {"chosen": "The sky is blue.", "rejected": "The sky is green."}]  # fmt: skip
    conversational = [
        {
            "prompt": [{"role": "user", "content": "What color is the sky?"}],
            "chosen": [{"role": "assistant", "content": "It is blue."}],
            "rejected": [{"role": "assistant", "content": "It is green."}],
        },
        {
            "chosen": [
                {"role": "user", "content": "What color is the sky?"},
                {"role": "assistant", "content": "It is blue."},
            ],
            "rejected": [
                {"role": "user", "content": "What color is the sky?"},
                {"role": "assistant", "content": "It is green."},
            ],
        },
    ]
    sky_is = {
        "prompt": [{"role": "user", "content": "The sky is"}],
        "chosen": [{"role": "assistant", "content": " blue."}],
        "rejected": [{"role": "assistant", "content": " green."}],
    }
    for k, record in enumerate(standard):
        assert read(tmp_path, [record])[0] == [sky_is], k
    for k, record in enumerate(conversational):
        assert read(tmp_path, [record])[0] == [SKY], k
    assert [read(tmp_path, [r])[1] for r in standard + conversational] == [
        "prompt",
        "implicit",
        "prompt",
        "implicit",
    ]


def test_minimind_dpo_jsonl_and_a_multi_turn_implicit_prompt(tmp_path):
    # MiniMind's dataset/dpo.jsonl: chosen and rejected whole conversations, content before role.
    minimind = {
        "chosen": [
            {"content": "What color is the sky?", "role": "user"},
            {"content": "It is blue.", "role": "assistant"},
        ],
        "rejected": [
            {"content": "What color is the sky?", "role": "user"},
            {"content": "It is green.", "role": "assistant"},
        ],
    }
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    multi = {"chosen": history + minimind["chosen"], "rejected": history + minimind["rejected"]}
    pairs, fmt = read(tmp_path, [minimind, multi])
    assert fmt == "implicit" and pairs[0] == SKY
    assert pairs[1] == {**SKY, "prompt": [*history, *SKY["prompt"]]}


def test_chosen_row_is_sfts_conversation_with_the_prompt_untrained(tok):
    """The same template and ids as SFT: the chosen row equals SFT's encoding of the conversation, with
    the labels of the history's assistant turn masked; tools and system go through the same template."""
    tools = [{"type": "function", "function": {"name": "color", "parameters": {"type": "object"}}}]
    prompt = [
        {"role": "tools", "tools": tools},
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        *SKY["prompt"],
    ]
    pair = {**SKY, "prompt": prompt}
    (example,), n_cut, n_reply = encode([pair], tok, 256)
    (sft,), _ = encode_conversations([prompt + SKY["chosen"]], tok, 256)
    assert example["prompt_ids"] + example["chosen_ids"] == sft["input_ids"]
    labels = [IGNORE_INDEX] * len(example["prompt_ids"]) + example["chosen_labels"]
    reply_starts = len(example["prompt_ids"])
    assert labels[reply_starts:] == sft["labels"][reply_starts:]
    # SFT trains "Hello!"; a pair does not
    assert any(label != IGNORE_INDEX for label in sft["labels"][:reply_starts])
    rejected = encode_conversations([prompt + SKY["rejected"]], tok, 256)[0][0]["input_ids"]
    assert example["prompt_ids"] + example["rejected_ids"] == rejected and (n_cut, n_reply) == (0, 0)
    tally = Tally()  # a prompt cut keeps the tools list and system turn, and says so
    (cut,), n_cut, n_reply = encode([pair], tok, len(example["prompt_ids"]), tally=tally)
    kept = tok.decode(cut["prompt_ids"])
    assert (
        kept.startswith("<|tools|>\n[{") and "<|system|>\nBe brief.<|end|>" in kept and "Hello!" not in kept
    )
    assert (n_cut, n_reply, tally.tools_kept) == (1, 0, 1) and cut["chosen_ids"] == example["chosen_ids"]


def test_chatlm_raw_strings_under_template_none_causal_and_t5(tmp_path):
    tok = make_tokenizer()
    ensure_special_tokens(tok, "none")
    pairs, fmt = read(tmp_path, [{"prompt": "你好", "chosen": "你好！", "rejected": "走开"}])
    assert fmt == "prompt"
    none, eos = Rendering(template="none"), tok.eos_token_id

    def ids(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    (causal,), _, _ = encode(pairs, tok, 64, CAUSAL_LM, none)
    assert causal["prompt_ids"] == ids("你好") + [eos]  # the prefix: prompt + eos, not trained
    assert causal["chosen_ids"] == causal["chosen_labels"] == ids("你好！") + [eos]
    assert causal["rejected_ids"] == ids("走开") + [eos]
    (t5,), _, _ = encode(pairs, tok, 64, ENCODER_DECODER, none)
    assert t5["prompt_ids"] == ids("你好") + [eos]  # the encoder source, once per pair
    assert t5["chosen_labels"] == ids("你好！") + [eos] and t5["rejected_labels"] == ids("走开") + [eos]
    sft, _ = encode_pairs([pairs[0]["prompt"] + pairs[0]["chosen"]], tok, 64, none)
    assert sft == [{"input_ids": t5["prompt_ids"], "labels": t5["chosen_labels"]}]


def test_truncation_cuts_the_prompt_once_for_both_sides(tok):
    history = [{"role": "user", "content": f"Question {i} about the quick brown fox."} for i in range(6)]
    pair = {**SKY, "prompt": [{"role": "system", "content": "Be brief."}, *history, *SKY["prompt"]]}
    (whole,), _, _ = encode([pair], tok, 1024)
    system = tok("<|system|>\nBe brief.<|end|>\n", add_special_tokens=False)["input_ids"]
    marker = tok("<|end|>\n<|assistant|>\n", add_special_tokens=False)["input_ids"]
    for truncation in ("keep_end", "keep_start"):
        (cut,), n_cut, n_reply = encode([pair], tok, 48, rendering=Rendering(truncation=truncation))
        assert (n_cut, n_reply) == (1, 0) and cut["chosen_ids"] == whole["chosen_ids"]
        prompt = cut["prompt_ids"]
        assert len(prompt) + max(len(cut["chosen_ids"]), len(cut["rejected_ids"])) <= 48
        assert prompt[: len(system)] == system and prompt[-len(marker) :] == marker  # kept by any cut
        rest = whole["prompt_ids"][len(system) : -len(marker)]
        kept = prompt[len(system) : -len(marker)]
        assert kept == (rest[len(rest) - len(kept) :] if truncation == "keep_end" else rest[: len(kept)])
    long = {**SKY, "chosen": [{"role": "assistant", "content": "blue " * 80}]}
    (cut,), n_cut, n_reply = encode([long], tok, 48)
    assert (n_cut, n_reply) == (1, 1) and len(cut["prompt_ids"]) + len(cut["chosen_ids"]) == 48
    assert cut["prompt_ids"] == encode([SKY], tok, 1024)[0][0]["prompt_ids"]  # a short prompt is whole


BAD = [
    ({"prompt": "Hi", "chosen": "Hello", "rejected": "Hello"}, "chosen and rejected are the same reply"),
    ({"prompt": "Hi", "chosen": "Hello"}, "no 'rejected' reply"),
    ({"prompt": "Hi", "chosen": "Hello", "rejected": " "}, "no response ('rejected' is empty)"),
    ({"prompt": "Hi", "chosen": "Hello", "rejected": [{"role": "assistant", "content": ""}]},
     "'rejected': no response (assistant turn 1 is empty)"),
    ({"chosen": [{"role": "user", "content": "A"}, {"role": "assistant", "content": "B"}],
      "rejected": [{"role": "user", "content": "C"}, {"role": "assistant", "content": "D"}]},
     "the 'chosen' reply starts with a user turn"),
]


@pytest.mark.parametrize("record, reason", BAD)
def test_a_bad_record_is_one_line_naming_the_file_and_line(tmp_path, record, reason):
    good = {"prompt": "Hi", "chosen": "Hello", "rejected": "Go away"}
    if "prompt" not in record:  # a file is one format: the implicit prompt's good records
        good = {side: [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": reply}]
                for side, reply in (("chosen", "Hello"), ("rejected", "Go away"))}  # fmt: skip
    path = write(tmp_path, [good, record, good])
    with pytest.raises(UsageError) as err:
        load_pairs(path)
    message = str(err.value)
    assert message.startswith(f"DATA_PATH: {path} line 2: ") and reason in message and "\n" not in message
    assert "SKIP_BAD_RECORDS=1" in message
    pairs, _, skipped = load_pairs(path, skip_bad_records=True)
    assert (len(pairs), skipped) == (2, 1)


def test_unknown_format_and_sft_data_are_one_line(tmp_path):
    with pytest.raises(UsageError, match="unknown preference format .*SFT data trains with"):
        load_pairs(write(tmp_path, [{"messages": [{"role": "user", "content": "Hi"}]}]))
    with pytest.raises(UsageError, match="no records"):
        load_pairs(write(tmp_path, [], "empty.jsonl"))
