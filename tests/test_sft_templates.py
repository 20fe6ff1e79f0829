"""SFT rendering knobs on real tokenizers and a tiny real model: TEMPLATE=none (raw source + eos ->
target + eos, causal and encoder-decoder), LOSS_ON=all, TRUNCATION's exact kept ids with the tools
list kept, reasoning_content and loss_weight spans, plain-text records, the saved template's
{% generation %} mask equal to the kit's trained tokens, golden losses, and a bad TEMPLATE in one line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from test_sft_data import ids_of, make_tokenizer, trained_runs

from conftest import read_jsonl, run_cli
from train.core.units import IGNORE_INDEX
from train.data.chat.encode import (
    PadCollator,
    Rendering,
    Tally,
    encode_conversations,
    encode_pairs,
    ensure_special_tokens,
)
from train.data.chat.formats import load_conversations, to_conversation
from train.data.chat.turns import split_tools
from train.models.family import CAUSAL_LM

GOLDEN = Path(__file__).parent / "golden" / "sft_template_losses.json"
SCHEMA = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
TOOL_RECORD = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "content": '{"temp_c": 21}'},
        {"role": "assistant", "content": "It is 21 degrees."},
    ],
    "tools": [SCHEMA],
}
MULTI = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say hello."},
    {"role": "assistant", "content": "Hello world."},
    {"role": "user", "content": "And the fox?"},
    {"role": "assistant", "content": "The quick brown fox."},
]
THINKING = [
    {"role": "user", "content": "Say hello."},
    {"role": "assistant", "content": "Hello.", "loss_weight": 0},
    {"role": "user", "content": "And the fox?"},
    {"role": "assistant", "content": "The fox.", "reasoning_content": "Foxes are quick."},
]
PAIRS = [{"prompt": f"Say {i} twice.", "response": f"{i} {i}." * (1 + i % 3)} for i in range(16)]


@pytest.fixture(scope="module")
def tok():
    tokenizer = make_tokenizer()
    ensure_special_tokens(tokenizer)
    return tokenizer


@pytest.fixture(scope="module")
def raw_tok():
    tokenizer = make_tokenizer()
    ensure_special_tokens(tokenizer, "none")
    return tokenizer


def labels_trained(example) -> list[bool]:
    return [label != IGNORE_INDEX for label in example["labels"]]


def test_none_is_source_eos_then_target_eos(raw_tok):
    """Causal: tokenizer(source) + eos untrained, target + eos trained; no role markers. Several
    turns: the turns before each reply a line each. Encoder-decoder: the source as tokenizer(source)
    gives it, with eos appended only where the tokenizer adds none (here its post-processor does)."""
    from tokenizers.processors import TemplateProcessing

    eos, none = raw_tok.eos_token_id, Rendering(template="none")
    assert raw_tok.chat_template is None and "<|user|>" not in raw_tok.get_vocab()
    pair = [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello world."}]
    (example,), _ = encode_conversations([pair], raw_tok, 512, none)
    source, target = raw_tok("Say hello.")["input_ids"] + [eos], ids_of(raw_tok, "Hello world.") + [eos]
    assert example["input_ids"] == source + target
    assert example["labels"] == [IGNORE_INDEX] * len(source) + target
    (multi,), _ = encode_conversations([MULTI], raw_tok, 512, none)
    assert multi["input_ids"] == ids_of(raw_tok, "You are terse.\nSay hello.<|endoftext|>Hello "
                                                 "world.<|endoftext|>"
                                                 "And the fox?<|endoftext|>The quick brown fox.<|endoftext|>")
    assert trained_runs(multi) == [ids_of(raw_tok, "Hello world.") + [eos], ids_of(raw_tok, "The quick brown "
                                                                                            "fox.") + [eos]]
    pairs, _ = encode_pairs([MULTI], raw_tok, 512, none)
    assert [p["input_ids"] for p in pairs] == [ids_of(raw_tok, "You are terse.\nSay hello.") + [eos],
                                               ids_of(raw_tok, "You are terse.\nSay hello.\nHello "
                                                               "world.\nAnd the fox?") + [eos]]
    assert pairs[1]["labels"] == ids_of(raw_tok, "The quick brown fox.") + [eos]
    t5_like = make_tokenizer()  # tokenizer(text) ends in eos, as T5's does
    t5_like.backend_tokenizer.post_processor = TemplateProcessing(single=f"$A {t5_like.eos_token}",
                                                                  special_tokens=[(t5_like.eos_token, eos)])
    ensure_special_tokens(t5_like, "none")
    (t5_pair,), _ = encode_pairs([pair], t5_like, 512, none)
    assert t5_pair["input_ids"] == t5_like("Say hello.")["input_ids"] == ids_of(t5_like, "Say hello.") + [eos]
    assert t5_pair["labels"] == ids_of(t5_like, "Hello world.") + [eos]


def test_loss_on_all_trains_every_token_but_pad(tok):
    (example,), _ = encode_conversations([MULTI], tok, 512, Rendering(loss_on="all"))
    assert example["labels"] == example["input_ids"]
    (short,), _ = encode_conversations([MULTI[1:3]], tok, 512, Rendering(loss_on="all"))
    batch = PadCollator(tok.pad_token_id)([example, short])
    assert (batch["labels"][1, len(short["input_ids"]) :] == IGNORE_INDEX).all()
    assert batch["labels"][1, : len(short["input_ids"])].tolist() == short["input_ids"]
    with pytest.raises(Exception, match="LOSS_ON=all: an encoder-decoder"):
        encode_pairs([MULTI], tok, 512, Rendering(loss_on="all"))


def test_reasoning_and_loss_weight_spans(tok):
    """reasoning_content renders as <think> before the content and trains with it (REASONING=drop:
    gone); an assistant turn with loss_weight 0 is in the input but not trained."""
    (example,), _ = encode_conversations([THINKING], tok, 512)
    assert trained_runs(example) == [ids_of(tok, "<think>\nFoxes are quick.\n</think>\nThe fox.<|end|>")]
    assert ids_of(tok, "Hello.<|end|>")[0] in example["input_ids"]
    (dropped,), _ = encode_conversations([THINKING], tok, 512, Rendering(reasoning="drop"))
    assert trained_runs(dropped) == [ids_of(tok, "The fox.<|end|>")] and "think" not in tok.decode(
        dropped["input_ids"]
    )
    pairs, _ = encode_pairs([THINKING], tok, 512)
    assert [p["labels"] for p in pairs] == [
        ids_of(tok, "<think>\nFoxes are quick.\n</think>\nThe fox.") + [tok.eos_token_id]
    ]
    own = make_tokenizer()  # a tokenizer's own template that reads reasoning_content (as Qwen3's does)
    own.chat_template = ("{% for m in messages %}[{{ m['role'] }}]{% if m['reasoning_content'] %}({{ "
                         "m['reasoning_content'] }})"
                         "{% endif %}{{ m['content'] }}.{% endfor %}{% if add_generation_prompt "
                         "%}[assistant]{% endif %}")
    ensure_special_tokens(own)
    (mine,), _ = encode_conversations([THINKING], own, 512)
    assert trained_runs(mine) == [ids_of(own, "(Foxes are quick.)The fox..")]
    everything_weighted_zero = [THINKING[0], THINKING[1]]
    tally = Tally()
    assert encode_conversations([everything_weighted_zero], tok, 512, tally=tally)[0] == []
    assert tally.refused == [(0, "has nothing to train (every assistant turn has loss_weight 0)")]


def test_truncation_keeps_exact_ids_and_the_tools_list(tok):
    """A record with tools whose prompt fills MAX_LENGTH: the tools list and system turn stay, the
    history is cut at its end (keep_end) or start (keep_start), then the reply's start; causal and
    encoder-decoder. A tools list that alone fills MAX_LENGTH: the record cannot fit (counted, not trained).
    """
    long_user, long_reply = " ".join(f"word{i}" for i in range(60)), " ".join(["Fine thanks."] * 40)
    conv = to_conversation(
        {
            **TOOL_RECORD,
            "messages": [
                TOOL_RECORD["messages"][0],
                {"role": "user", "content": long_user},
                {"role": "assistant", "content": long_reply},
            ],
        },
        "messages",
    )
    tools, _ = split_tools(conv)
    pinned = ids_of(tok, f"<|tools|>\n{json.dumps(tools)}<|end|>\n<|system|>\nBe brief.<|end|>\n")
    history = ids_of(tok, f"<|user|>\n{long_user}<|end|>\n<|assistant|>\n")
    reply = ids_of(tok, f"{long_reply}<|end|>")
    (whole,), _ = encode_conversations([conv], tok, 10_000)
    assert whole["input_ids"] == pinned + history + reply + ids_of(tok, "\n")
    marker = ids_of(tok, "<|end|>\n<|assistant|>\n")  # "reply now": every cut keeps it before the reply
    assert history[-len(marker) :] == marker
    # half the window is source; or the tools list needs more
    for m in (2 * len(pinned) + 20, len(pinned) + 6):
        keep = max(m // 2, len(pinned) + len(marker))
        assert len(pinned) + len(history) > m and len(reply) > m - keep
        expect = {"keep_end": pinned + history[len(history) - (keep - len(pinned)) :],
                  "keep_start": pinned + history[: keep - len(pinned) - len(marker)] + marker}  # fmt: skip
        for mode, source in expect.items():
            tally = Tally()
            (cut,), n = encode_conversations([conv], tok, m, Rendering(truncation=mode), tally)
            assert (n, tally.tools_kept) == (1, 1)
            kept = reply[: m - keep - 1] + reply[-1:]  # a cut reply keeps its <|end|> in its last place
            assert cut["input_ids"] == source + kept
            assert cut["labels"] == [IGNORE_INDEX] * keep + kept
            (pair,), n = encode_pairs([conv], tok, m, Rendering(truncation=mode), tally)
            seq2seq = {"keep_end": pinned + history[len(history) - (m - len(pinned)) :],
                       "keep_start": (pinned + history)[: m - len(marker)] + marker}  # fmt: skip
            assert (
                n == 1
                and pair["input_ids"] == seq2seq[mode]
                and pair["labels"] == reply[:-1][: m - 1] + [tok.eos_token_id]
            )
            assert tally.tools_kept == 2  # the pair too: its history cut, its tools list kept
    tally = Tally()
    assert encode_conversations([conv], tok, len(pinned), tally=tally)[0] == []
    assert tally.unfit[0][1] == (f"cannot fit MAX_LENGTH={len(pinned)} tokens: its tools list and system "
                                 f"turn "
                                 f"take {len(pinned)} tokens, leaving no room for a reply (shorten it, or "
                                 f"train a model with a longer context)")  # fmt: skip


def test_plain_text_records_train_whole(tok, tmp_path):
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": f"The quick brown fox {i}."}) + "\n" for i in range(3)))
    conversations, fmt, _ = load_conversations(data)
    assert fmt == "text" and conversations[0] == [{"role": "text", "content": "The quick brown fox 0."}]
    (example, *_), _ = encode_conversations(conversations, tok, 512)
    assert (
        example["input_ids"]
        == example["labels"]
        == ids_of(tok, "The quick brown fox 0.") + [tok.eos_token_id]
    )


@pytest.fixture(scope="module")
def runs(base_model, tmp_path_factory):
    """Two seeded SFT runs of the tiny GPT-2: TEMPLATE=none and LOSS_ON=all."""
    root = tmp_path_factory.mktemp("templates")
    data = root / "pairs.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    out = {}
    for name, flags in {"none": ["--template", "none"], "all": ["--loss_on", "all"]}.items():
        argv = [
            "sft",
            "--model_path",
            str(base_model),
            "--data_path",
            str(data),
            "--output_dir",
            str(root / "runs"),
            "--cache_dir",
            str(root / "cache"),
            "--max_length",
            "64",
            "--batch_size",
            "4",
            "--log_every",
            "1",
            "--num_workers",
            "0",
            "--tokenize_workers",
            "1",
            "--max_steps",
            "3",
            "--seed",
            "7",
            "--learning_rate",
            "3e-3",
            "--val_fraction",
            "0",
            "--run_name",
            name,
            *flags,
        ]
        assert run_cli(*argv) == 0
        out[name] = root / "runs" / name
    return out


def test_golden_losses_for_none_and_all(runs):
    got = {
        name: [r["loss"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]
        for name, run in runs.items()
    }
    if os.environ.get("UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(json.dumps(got, indent=1) + "\n")
    golden = json.loads(GOLDEN.read_text())
    assert sorted(got) == sorted(golden)
    for key in golden:
        np.testing.assert_allclose(got[key], golden[key], rtol=2e-4, err_msg=key)
    assert got["none"] != got["all"]
    config = json.loads((runs["all"] / "config.json").read_text())
    assert (
        "template = builtin" in (runs["all"] / "train.log").read_text()
        and config["config"]["data"]["loss_on"] == "all"
    )


def test_final_template_mask_equals_the_trained_tokens(runs):
    """transformers' return_assistant_tokens_mask on final/'s saved template ({% generation %})
    marks exactly the tokens the kit trains: alpaca, multi-turn, tool calls, reasoning + loss_weight."""
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(runs["all"] / "final", local_files_only=True)
    raw = AutoTokenizer.from_pretrained(runs["none"] / "final", local_files_only=True)
    records = [
        to_conversation({"instruction": "Name a fruit.", "input": "Red.", "output": "An apple."}, "alpaca"),
        MULTI,
        to_conversation(TOOL_RECORD, "messages"),
        THINKING,
    ]
    for tokenizer, rendering in ((saved, Rendering()), (raw, Rendering(template="none"))):
        for conversation in records:
            tools, turns = split_tools(conversation)
            (example,), _ = encode_conversations([conversation], tokenizer, 10_000, rendering)
            out = tokenizer.apply_chat_template(list(turns), tools=tools, tokenize=True, return_dict=True,
                                                return_assistant_tokens_mask=True)
            assert out["input_ids"] == example["input_ids"]
            assert [bool(m) for m in out["assistant_masks"]] == labels_trained(example), conversation
    # TEMPLATE=none's final/ prompts the way it trained: the raw source + eos, no role markers.
    assert raw.apply_chat_template(MULTI[:2], add_generation_prompt=True, tokenize=False) == (
        "You are terse.\nSay hello." + raw.eos_token)


def test_a_bad_template_is_one_line(base_model, tmp_path, capsys):
    argv = ["sft", "--model_path", str(base_model), "--output_dir", str(tmp_path / "runs"),
            "--cache_dir", str(tmp_path / "cache"), "--max_steps", "1", "--template"]  # fmt: skip
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m['content'] }")
    for template, words in (
        (str(tmp_path / "missing.jinja"), "no such file"),
        (str(broken), "does not render"),
    ):
        assert run_cli(*argv, template) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "TEMPLATE" in err and words in err, err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_a_template_file_renders_and_is_said_to_lack_markers(tmp_path):
    """TEMPLATE=<file>: its Jinja becomes the chat template (the trained spans found through it); a
    file without {% generation %} is said in the log, TEMPLATE empty is recorded as a decision."""
    from types import SimpleNamespace

    from train.data.chat.template_table import template_decision

    path = tmp_path / "chatml.jinja"
    path.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>\n{% endfor %}"
                    "{% if add_generation_prompt %}<assistant>{% endif %}")
    tokenizer = make_tokenizer()
    assert ensure_special_tokens(tokenizer, str(path)) == 0 and tokenizer.chat_template == path.read_text()
    (example,), _ = encode_conversations([MULTI[1:3]], tokenizer, 512, Rendering(template=str(path)))
    assert trained_runs(example) == [ids_of(tokenizer, "Hello world.</s>")]
    said, decided = [], {}
    d = SimpleNamespace(template=str(path), loss_on=None, truncation=None, reasoning=None)
    template_decision(
        d, tokenizer, CAUSAL_LM, said.append, lambda name, value, why: decided.update({name: value})
    )
    assert decided == {} and "no {% generation %} markers" in said[0]
    said.clear()
    template_decision(
        SimpleNamespace(**{**vars(d), "template": None}),
        make_tokenizer(),
        CAUSAL_LM,
        said.append,
        lambda name, value, why: decided.update({name: value}),
    )
    assert decided == {"template": "builtin"} and said == []
