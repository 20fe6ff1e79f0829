"""A conversation renders a bounded number of times, not twice per trained turn: a 2,000-turn
conversation through a TEMPLATE file costs about twice a 1,000-turn one (counted in renders and
characters rendered), and on small conversations every template gives the segments (so the masks)
that rendering each trained turn's prefixes gives, refusals included."""

from __future__ import annotations

import dataclasses
import functools

import pytest
from test_sft_data import make_tokenizer
from test_sft_tools import OWN_TEMPLATE

from train.core.errors import UsageError
from train.data.chat import chat_template, template_table
from train.data.chat.chat_template import template_segments
from train.data.chat.encode import Rendering, encode_conversations, ensure_special_tokens
from train.data.chat.templates import BUILTIN_CHAT_TEMPLATE

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # fmt: skip
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
THINKS = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['reasoning_content'] %}<think>\n"
          "{{ m['reasoning_content'] }}\n</think>\n\n{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # fmt: skip
BRACKETS = (
    "{% for m in messages %}[{{ m['role'] }}]{% if m['reasoning_content'] %}({{ "
    "m['reasoning_content'] }})"
    "{% endif %}{{ m['content'] }}.{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
)
NUMBERED = ("{% for m in messages %}#{{ loop.index }} {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}#{{ messages | length + 1 }} assistant: {% endif %}")  # fmt: skip
LAST_EOS = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% if loop.last %}</s>{% endif %}\n"
            "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")  # fmt: skip
GROWING = ("{% for m in messages %}<{{ m['role'] }}{{ '!' * (messages | length - loop.index) }}>{{ "
           "m['content'] }}\n"
           "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")  # fmt: skip
TEMPLATES = {
    "chatml": CHATML,
    "llama3": LLAMA3,
    "thinks": THINKS,
    "brackets": BRACKETS,
    "numbered": NUMBERED,
    "tools": OWN_TEMPLATE,
    "builtin_file": BUILTIN_CHAT_TEMPLATE,
    "last_eos": LAST_EOS,
    "growing": GROWING,
}

CALL = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
TOOLS = {"role": "tools", "tools": [{"name": "get_weather", "parameters": {"type": "object"}}]}


def pairs(n: int, **extra) -> list[dict]:
    turns = []
    for k in range(n):
        turns += [
            {"role": "user", "content": f"Question {k}?"},
            {"role": "assistant", "content": f"Answer {k}.", **extra},
        ]
    return turns


CONVERSATIONS = {
    "plain": pairs(3),
    "system": [{"role": "system", "content": "Be brief."}, *pairs(4)],
    "weighted": [*pairs(1), *pairs(1, loss_weight=0), *pairs(3)],
    "reasoning": [
        *pairs(2, reasoning_content="Think it over."),
        *pairs(1),
        *pairs(1, reasoning_content="Again."),
    ],
    "spaces": [{"role": "user", "content": " Hi "}, {"role": "assistant", "content": " Hello \n"}, *pairs(3)],
    "calls": [
        TOOLS,
        {"role": "system", "content": "Use tools."},
        *pairs(1),
        {"role": "user", "content": "Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "content": '{"t": 21}'},
        {"role": "assistant", "content": "It is 21.", "tool_calls": [CALL]},
        {"role": "user", "content": "Again?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "content": "{}"},
        *pairs(2),
    ],
}


@pytest.fixture(scope="module")
def tokenizer():
    tok = make_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|eot_id|>"]})
    return tok


def outcome(fn):
    try:
        return fn()
    except UsageError as err:
        return ("refused", str(err))


OWN_ONLY = ("chatml", "llama3", "numbered", "last_eos", "growing")  # no tools list, calls or reasoning


@pytest.mark.parametrize("name", TEMPLATES)
def test_segments_equal_the_per_turn_prefixes(tokenizer, name, monkeypatch):
    monkeypatch.setattr(tokenizer, "chat_template", TEMPLATES[name])
    fewer = []
    for key, conversation in CONVERSATIONS.items():
        if name in OWN_ONLY and key in ("calls", "reasoning"):
            continue  # a template that would drop them is refused before rendering (test_sft_tools)
        slow, fast = [], []
        monkeypatch.setattr(chat_template, "render_chat", counted(chat_template.render_chat, slow))
        expected = outcome(lambda c=conversation: template_segments(tokenizer, c, per_turn=True))
        monkeypatch.setattr(
            chat_template, "render_chat", counted(chat_template.render_chat.__wrapped__, fast)
        )
        assert outcome(lambda c=conversation: template_segments(tokenizer, c)) == expected, (name, key)
        fewer.append(len(fast) < len(slow))
    if name in ("chatml", "numbered", "brackets", "builtin_file", "thinks"):
        assert sum(fewer) >= 3, "the one-render path was not taken"
    if name in ("last_eos", "growing"):  # not prefix-stable: refused on both paths, as before
        assert expected[0] == "refused"


def counted(render, calls: list):
    @functools.wraps(render)
    def wrapper(*args, **kwargs):
        out = render(*args, **kwargs)
        calls.append(len(out))
        return out

    return wrapper


def test_a_template_file_trains_the_same_ids_both_ways(tokenizer, tmp_path, monkeypatch):
    path = tmp_path / "thinks.jinja"
    path.write_text(THINKS)
    tok = make_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    ensure_special_tokens(tok, str(path))
    records = [c for c in CONVERSATIONS.values() if c[0]["role"] != "tools"]
    fast, _ = encode_conversations(records, tok, 4096, Rendering(template=str(path)))
    entry = template_table.TEMPLATE["file"]
    per_turn = dataclasses.replace(entry, segments=functools.partial(template_segments, per_turn=True))
    monkeypatch.setitem(template_table.TEMPLATE, "file", per_turn)
    slow, _ = encode_conversations(records, tok, 4096, Rendering(template=str(path)))
    assert len(fast) == len(records) and fast == slow


def rendered_cost(tokenizer, turns: int, monkeypatch) -> tuple[int, int]:
    calls: list[int] = []
    monkeypatch.setattr(chat_template, "render_chat", counted(chat_template.render_chat, calls))
    segments = template_segments(tokenizer, [{"role": "system", "content": "Be brief."}, *pairs(turns // 2)])
    monkeypatch.undo()
    assert sum(flag == 1 for _, flag in segments) == turns // 2
    return len(calls), sum(calls)


def test_two_thousand_turns_render_a_bounded_number_of_times(tokenizer, tmp_path, monkeypatch):
    path = tmp_path / "chatml.jinja"
    path.write_text(CHATML)
    ensure_special_tokens(tokenizer, str(path))
    small, big = rendered_cost(tokenizer, 1000, monkeypatch), rendered_cost(tokenizer, 2000, monkeypatch)
    assert big[0] == small[0] <= 7, (small, big)  # per turn: 2 per trained turn, 2,000 here
    assert 1.8 < big[1] / small[1] < 2.2, (small, big)  # characters rendered: linear, not the square


@pytest.mark.parametrize("template", ["builtin", "none"])
def test_builtin_and_none_never_render(template, monkeypatch):
    """The built-in template and TEMPLATE=none write their segments in Python, one pass."""
    tok = make_tokenizer()
    ensure_special_tokens(tok, template)
    calls: list[int] = []
    monkeypatch.setattr(chat_template, "render_chat", counted(chat_template.render_chat, calls))
    (example,), _ = encode_conversations([pairs(1000)], tok, 1 << 20, Rendering(template=template))
    assert calls == [] and len(example["input_ids"]) > 10_000
