"""SFT data: formats, errors, the loss mask, padding-aware batching. A tiny byte-level BPE is
trained in the test (milliseconds), so nothing is downloaded."""

from __future__ import annotations

import json
import random

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerFast

from train.core.errors import UsageError
from train.data.chat.encode import (
    BUILTIN_CHAT_TEMPLATE,
    IGNORE_INDEX,
    LengthGroupedSampler,
    PadCollator,
    TokenBudgetBatchSampler,
    builtin_conversations,
    encode_conversations,
    ensure_special_tokens,
    load_conversations,
    padding_efficiency,
    prompt_for_generation,
    render,
    stop_token_ids,
)

CHINESE = "你好，世界。今天天气很好。"
CORPUS = [
    "Hello world, how are you today? I am fine, thank you.",
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.",
    CHINESE,
]
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say hello."},
    {"role": "assistant", "content": "Hello world."},
    {"role": "user", "content": "And the fox?"},
    {"role": "assistant", "content": "The quick brown fox."},
]


def make_tokenizer() -> PreTrainedTokenizerFast:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(CORPUS * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    tokenizer = make_tokenizer()
    ensure_special_tokens(tokenizer)
    return tokenizer


def write_jsonl(path, records) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")


def ids_of(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def trained_runs(example) -> list[list[int]]:
    """Contiguous runs of token ids whose label is not -100."""
    runs, current = [], []
    for token, label in zip(example["input_ids"], example["labels"], strict=True):
        if label != IGNORE_INDEX:
            assert label == token
            current.append(token)
        elif current:
            runs, current = runs + [current], []
    return runs + [current] if current else runs


# --- loading -----------------------------------------------------------------------------------

FORMAT_RECORDS = {
    "alpaca": [
        {"instruction": "Add numbers.", "input": "2 and 3", "output": "5"},
        {"instruction": "Greet.", "input": "", "output": "Hello."},
        {"instruction": "Greet again.", "output": "Hi."},
    ],
    "messages": [
        {
            "messages": [
                {"role": "system", "content": "Be kind."},
                {"role": "user", "content": "Add 2 and 3"},
                {"role": "assistant", "content": "5"},
            ]
        },
    ],
    "sharegpt": [
        {
            "conversations": [
                {"from": "system", "value": "Be kind."},
                {"from": "human", "value": "Add 2 and 3"},
                {"from": "gpt", "value": "5"},
                {"from": "user", "value": "Thanks"},
                {"from": "assistant", "value": "Welcome."},
            ]
        },
    ],
    "prompt_response": [{"prompt": "Add 2 and 3", "response": "5"}],
}


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
@pytest.mark.parametrize("fmt", list(FORMAT_RECORDS))
def test_each_format_is_detected_and_parsed(tmp_path, fmt, suffix):
    path = tmp_path / f"data{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(FORMAT_RECORDS[fmt]), encoding="utf-8")
    else:
        write_jsonl(path, FORMAT_RECORDS[fmt])
    conversations, name, skipped = load_conversations(path)
    assert (name, skipped, len(conversations)) == (fmt, 0, len(FORMAT_RECORDS[fmt]))
    first = conversations[0]
    assert {"role": "assistant", "content": "5"} in first
    assert {t["role"] for c in conversations for t in c} <= {"system", "user", "assistant"}
    if fmt == "alpaca":
        assert first[0] == {"role": "user", "content": "Add numbers.\n2 and 3"}
        assert conversations[1][0]["content"] == "Greet." and conversations[2][0]["content"] == "Greet again."
    if fmt in ("messages", "sharegpt"):
        assert first[0] == {"role": "system", "content": "Be kind."}
        assert first[1] == {"role": "user", "content": "Add 2 and 3"}
    if fmt == "sharegpt":
        assert [t["role"] for t in first] == ["system", "user", "assistant", "user", "assistant"]


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "response": "b"}\n\n{"prompt": "a", "response": \n', encoding="utf-8")
    with pytest.raises(UsageError, match=r"bad\.jsonl line 3: not valid JSON") as e:
        load_conversations(path)
    assert "\n" not in str(e.value)


def test_json_errors_name_the_record(tmp_path):
    path = tmp_path / "data.json"
    path.write_text(json.dumps([{"prompt": "a", "response": "b"}, {"prompt": "a", "response": ""}]))
    with pytest.raises(UsageError, match=r"data\.json record 2: no response"):
        load_conversations(path)


@pytest.mark.parametrize(
    "content, match",
    [
        ("", "empty"),
        ("\n  \n", "empty"),
        ('{"instruction": "x", "output": ""}\n', "line 1: no response"),
        ('{"messages": [{"role": "user", "content": "hi"}]}\n', "line 1: no response"),
        (
            '{"question": "x", "answer": "y"}\n',
            "unknown SFT format.*messages.*sharegpt.*alpaca.*prompt_response",
        ),
        ('{"conversations": [{"from": "robot", "value": "x"}]}\n', "line 1: turn 1 has role 'robot'"),
    ],
)
def test_bad_files_are_usage_errors(tmp_path, content, match):
    path = tmp_path / "d.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(UsageError, match=match):
        load_conversations(path)


def test_missing_file_and_non_utf8(tmp_path):
    with pytest.raises(UsageError, match="no such file"):
        load_conversations(tmp_path / "nope.jsonl")
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "a", "response": "b"}\n{"prompt": "caf\xe9", "response": "b"}\n')
    with pytest.raises(UsageError, match=r"latin1\.jsonl line 2: not UTF-8"):
        load_conversations(path)


def test_skip_bad_records_counts_and_still_refuses_all_bad(tmp_path):
    path = tmp_path / "mixed.jsonl"
    good = {"prompt": "p", "response": "r"}
    path.write_text(
        "\n".join(
            [
                json.dumps(good),
                "{oops",
                json.dumps({"prompt": "p", "response": " "}),
                json.dumps({"instruction": "x", "output": "y"}),
                json.dumps(good),
            ]
        )
    )
    conversations, fmt, skipped = load_conversations(path, skip_bad_records=True)
    assert (len(conversations), fmt, skipped) == (2, "prompt_response", 3)
    write_jsonl(path, [{"prompt": "p", "response": ""}] * 3)
    with pytest.raises(UsageError, match="all 3 records are bad"):
        load_conversations(path, skip_bad_records=True)


# --- template and loss mask ----------------------------------------------------------------------


def test_special_tokens_added_once_and_template_matches_jinja():
    tokenizer = make_tokenizer()
    assert ensure_special_tokens(tokenizer) == 7 and ensure_special_tokens(tokenizer) == 0
    assert tokenizer.pad_token == tokenizer.eos_token and tokenizer.chat_template == BUILTIN_CHAT_TEMPLATE
    text = "".join(t for t, _ in render(tokenizer, CHAT))
    assert text == tokenizer.apply_chat_template(CHAT, tokenize=False)
    assert prompt_for_generation(tokenizer, CHAT[:2]) == tokenizer.apply_chat_template(
        CHAT[:2], tokenize=False, add_generation_prompt=True
    )
    assert prompt_for_generation(tokenizer, "Hi").endswith("<|user|>\nHi<|end|>\n<|assistant|>\n")
    assert tokenizer.convert_tokens_to_ids("<|end|>") in stop_token_ids(tokenizer)


def test_labels_are_set_exactly_on_assistant_content(tok):
    conversation = CHAT[:3]
    (example,), n_truncated = encode_conversations([conversation], tok, max_length=512)
    assert n_truncated == 0
    # Segment-wise ids equal the ids of the whole rendered string: the model sees what inference sees.
    assert example["input_ids"] == ids_of(tok, "".join(t for t, _ in render(tok, conversation)))
    reply = ids_of(tok, "Hello world.<|end|>")
    trained = [i for i, label in enumerate(example["labels"]) if label != IGNORE_INDEX]
    assert [example["input_ids"][i] for i in trained] == reply
    assert trained == list(range(trained[0], trained[0] + len(reply)))  # one contiguous run
    prompt_ids = ids_of(tok, prompt_for_generation(tok, conversation[:2]))
    assert trained[0] == len(prompt_ids) and example["input_ids"][: len(prompt_ids)] == prompt_ids


def test_prompt_tokens_do_not_change_the_trained_tokens(tok):
    short = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello world."}]
    long = [{"role": "user", "content": "The quick brown fox, " * 5}, short[1]]
    (a, b), _ = encode_conversations([short, long], tok, max_length=512)
    assert trained_runs(a) == trained_runs(b) == [ids_of(tok, "Hello world.<|end|>")]
    assert sum(label != IGNORE_INDEX for label in a["labels"]) == sum(
        label != IGNORE_INDEX for label in b["labels"]
    )


def test_multi_turn_trains_on_every_assistant_turn(tok):
    (example,), _ = encode_conversations([CHAT], tok, max_length=512)
    assert trained_runs(example) == [
        ids_of(tok, "Hello world.<|end|>"),
        ids_of(tok, "The quick brown fox.<|end|>"),
    ]


def test_tokenizer_chat_template_path():
    tokenizer = make_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    assert ensure_special_tokens(tokenizer) == 0  # its own template: only the pad token is ensured
    (example,), _ = encode_conversations([CHAT], tokenizer, max_length=512)
    assert trained_runs(example) == [
        ids_of(tokenizer, "Hello world.<|im_end|>"),
        ids_of(tokenizer, "The quick brown fox.<|im_end|>"),
    ]
    assert example["input_ids"] == ids_of(tokenizer, tokenizer.apply_chat_template(CHAT, tokenize=False))
    assert prompt_for_generation(tokenizer, CHAT[:2]).endswith("<|im_start|>assistant\n")
    # A template that renders history differently as turns are added cannot be masked safely.
    tokenizer.chat_template = "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(UsageError, match="chat template"):
        encode_conversations([CHAT], tokenizer, max_length=512)


def test_truncation_is_counted_and_keeps_something_to_learn(tok):
    short = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    long_reply = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello world. " * 40}]
    long_prompt = [
        {"role": "user", "content": "The lazy dog. " * 60},
        {"role": "assistant", "content": "Yes."},
    ]
    examples, n_truncated = encode_conversations([short, long_reply, long_prompt], tok, max_length=32)
    assert n_truncated == 2 and len(examples) == 3
    assert all(len(e["input_ids"]) <= 32 for e in examples)
    assert all(any(label != IGNORE_INDEX for label in e["labels"]) for e in examples)


def test_chinese_round_trips(tok):
    conversation = [{"role": "user", "content": CHINESE}, {"role": "assistant", "content": CHINESE}]
    (example,), _ = encode_conversations([conversation], tok, max_length=512)
    assert tok.decode(example["input_ids"]) == "".join(t for t, _ in render(tok, conversation))
    reply = [
        t for t, label in zip(example["input_ids"], example["labels"], strict=True) if label != IGNORE_INDEX
    ]
    assert tok.decode(reply) == CHINESE + "<|end|>"
    assert tok.decode(reply, skip_special_tokens=True) == CHINESE


# --- batching ------------------------------------------------------------------------------------


def test_collator_pads_to_longest_in_batch():
    batch = PadCollator(pad_token_id=0)(
        [
            {"input_ids": [5, 6, 7], "labels": [-100, 6, 7]},
            {"input_ids": [8], "labels": [8]},
        ]
    )
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert (batch["n_real_tokens"], batch["n_padded_tokens"]) == (4, 6)
    assert PadCollator(0, pad_to_multiple_of=8)([{"input_ids": [1], "labels": [1]}])["input_ids"].shape == (
        1,
        8,
    )


def mixed_lengths(n=2000, seed=0) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice([rng.randint(5, 40), rng.randint(100, 500)]) for _ in range(n)]


def test_length_grouped_sampler_covers_each_index_and_cuts_padding():
    lengths, batch_size = mixed_lengths(), 16
    sampler = LengthGroupedSampler(lengths, batch_size, seed=1, epoch=0)
    order = list(sampler)
    assert sorted(order) == list(range(len(lengths))) and len(sampler) == len(lengths)
    assert order == list(LengthGroupedSampler(lengths, batch_size, seed=1, epoch=0))  # deterministic
    sampler.set_epoch(1)
    assert list(sampler) != order and sorted(sampler) == list(range(len(lengths)))
    grouped = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    shuffled = random.Random(0).sample(range(len(lengths)), len(lengths))
    plain = [shuffled[i : i + batch_size] for i in range(0, len(shuffled), batch_size)]
    assert padding_efficiency(lengths, grouped) > 0.9 > 0.5 > padding_efficiency(lengths, plain)
    assert max(lengths[i] for i in grouped[0]) == max(lengths)  # OOM shows at step 1


def test_token_budget_batches_respect_the_budget():
    lengths = mixed_lengths(500) + [3000]  # one sample over the budget
    sampler = TokenBudgetBatchSampler(lengths, max_tokens=2048, seed=0, epoch=0)
    batches = list(sampler)
    assert len(sampler) == len(batches)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert [len(lengths) - 1] in batches
    assert all(len(b) * max(lengths[i] for i in b) <= 2048 for b in batches if len(b) > 1)
    assert padding_efficiency(lengths, batches) > 0.85
    assert batches == list(TokenBudgetBatchSampler(lengths, 2048, seed=0, epoch=0))
    assert list(TokenBudgetBatchSampler(lengths, 2048, shuffle=False))[0] == [len(lengths) - 1]


def test_samplers_drive_a_dataloader(tok):
    conversations = [
        [
            {"role": "user", "content": "Hi " * (i % 7 + 1)},
            {"role": "assistant", "content": "Hello world. " * (i % 5 + 1)},
        ]
        for i in range(40)
    ]
    examples, _ = encode_conversations(conversations, tok, max_length=128)
    lengths = [len(e["input_ids"]) for e in examples]
    collate = PadCollator(tok.pad_token_id)
    loader = DataLoader(examples, batch_sampler=TokenBudgetBatchSampler(lengths, 256), collate_fn=collate)
    seen = sum(int(b["attention_mask"].sum()) for b in loader)
    assert seen == sum(lengths)
    loader = DataLoader(examples, batch_size=8, sampler=LengthGroupedSampler(lengths, 8), collate_fn=collate)
    batch = next(iter(loader))
    assert batch["input_ids"].dtype == torch.long and batch["input_ids"].shape[1] == max(
        int(n) for n in batch["attention_mask"].sum(1)
    )


# --- built-in default ----------------------------------------------------------------------------


def test_builtin_conversations_are_deterministic_and_varied():
    conversations = builtin_conversations(limit=300)
    assert len(conversations) == 300 and conversations == builtin_conversations(limit=300)
    for conversation in conversations[:50]:
        user, assistant = conversation
        assert user["role"] == "user" and user["content"].startswith("Write a Python function `")
        assert assistant["role"] == "assistant" and assistant["content"].strip()
        assert '"""' not in assistant["content"].splitlines()[0]  # the docstring is not in the answer
    sizes = sorted(len(c[1]["content"]) for c in conversations)
    assert sizes[-1] > 10 * sizes[len(sizes) // 10]
