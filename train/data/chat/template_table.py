"""TEMPLATE: one entry per way of rendering a conversation, in TEMPLATE (builtin, tokenizer, none,
and "file" for a Jinja file given as TEMPLATE). An entry says what the tokenizer's chat template
becomes (ensure_special_tokens), how a causal LM's conversation turns into (text, flag) segments,
how long the "reply now" marker a cut keeps is, whether an encoder-decoder reads raw contents, and
what a causal LM's final/ saves. The files that meet a TEMPLATE (encode, the SFT door) look it
up here instead of branching on its name; a new TEMPLATE is an entry. What each renders is in
train/data/chat/templates.py's module doc."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from train.core.errors import UsageError
from train.data.chat import templates
from train.data.chat.chat_template import template_segments
from train.data.chat.render_bounds import RenderFailed, render_chat
from train.data.chat.templates import (
    BUILTIN_CHAT_TEMPLATE,
    EARLIER_TEMPLATES,
    END_TOKEN,
    MARKERS,
    MASKED,
    PAD_TOKEN,
    PINNED,
    ROLE_TOKENS,
    TOOL_CALL_TOKEN,
    TOOLS_TOKEN,
    TRAINED,
    is_builtin,
    raw_template,
    read_template,
)
from train.data.chat.turns import call_text, split_tools


@dataclass(frozen=True)
class Template:
    """One TEMPLATE. chat_template(tokenizer, TEMPLATE) -> the tokenizer's chat template before
    the built-in fills an empty one (builtin_fills). segments(tokenizer, conversation) -> a
    causal LM's (text, flag) segments. marker(tokenizer) -> tokens of the "reply now" marker a
    source ends with. raw: an encoder-decoder reads the turns' contents (raw_pairs), eos ending
    the source. final(tokenizer) -> the chat template a causal LM's final/ saves (None: the
    tokenizer's as it is). own_markup: the template is the user's, which may lack
    {% generation %} markers (a note says so). why: the reason when an empty TEMPLATE chose it."""

    chat_template: Callable
    segments: Callable
    marker: Callable
    builtin_fills: bool = True
    checks_markers: bool = False
    raw: bool = False
    final: Callable | None = None
    own_markup: bool = False
    why: str = "the tokenizer has no other chat template"


def has_markers(tokenizer) -> bool:
    """The built-in template's marker tokens are in the vocabulary (ensure_special_tokens ran)."""
    # One id lookup, not get_vocab(): that builds a dict of the whole vocabulary per call, and
    # once per conversation it was most of SFT's start-up (a profile of 100k records).
    ids = tokenizer.convert_tokens_to_ids([END_TOKEN, TOOL_CALL_TOKEN])
    return not any(i is None or i == tokenizer.unk_token_id for i in ids)


def plain_prompt(conversation: Sequence[dict]) -> str:
    """A chat without a template to frame it (a pretraining run's tokenizer, TEMPLATE=none): the
    turns' texts, one a line, as a text model continues them; tools have nowhere to go."""
    return "\n".join(t.get("content") or "" for t in split_tools(conversation)[1])


def check_markers(tokenizer) -> None:
    if not has_markers(tokenizer):
        # A programming error, not a user one: the markers would be split into ordinary tokens.
        raise RuntimeError(
            "call ensure_special_tokens(tokenizer) before rendering with the built-in template"
        )


def builtin_segments(conversation: Sequence[dict]) -> list[tuple[str, int]]:
    """The built-in template's segments: the characters of BUILTIN_CHAT_TEMPLATE (a test holds them equal)."""
    tools, turns = split_tools(conversation)
    segments: list[tuple[str, int]] = []
    if tools:
        segments.append((f"{TOOLS_TOKEN}\n{json.dumps(tools, ensure_ascii=False)}{END_TOKEN}\n", PINNED))
    leading = True  # the system turns before the first other one: kept by truncation with the tools
    for turn in turns:
        leading = leading and turn["role"] == "system"
        calls = "".join(TOOL_CALL_TOKEN + call_text(call) for call in turn.get("tool_calls") or ())
        around = PINNED if leading else MASKED
        body = templates.think(turn) + turn["content"] + calls + END_TOKEN
        segments += [
            (f"{ROLE_TOKENS[turn['role']]}\n", around),
            (body, TRAINED if templates.trained(turn) else around),
            ("\n", around),
        ]
    return segments


def _raw_segments(tokenizer, conversation) -> list[tuple[str, int]]:
    tools, turns = split_tools(conversation)
    return templates.raw_segments(turns, tools, templates.eos_text(tokenizer), templates.bos_text(tokenizer))


def _marker_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else 0


def _own_marker(tokenizer) -> int:
    """What follows a user turn's text when the tokenizer's template is asked for the generation prompt."""
    probe = "PROBE"
    try:
        rendered = render_chat(tokenizer, [{"role": "user", "content": probe}], add_generation_prompt=True)
    except RenderFailed:  # a template that will not render a lone user turn: no marker known
        return 0
    return _marker_tokens(
        tokenizer, rendered[rendered.rfind(probe) + len(probe) :] if probe in rendered else ""
    )


def _own(tokenizer, template) -> str | None:
    """The tokenizer's own chat template (an earlier SFT run's built-in one: brought up to the current)."""
    if tokenizer.chat_template in EARLIER_TEMPLATES:
        return None
    if template == "tokenizer" and tokenizer.chat_template is None:
        raise UsageError("TEMPLATE=tokenizer: the tokenizer (MODEL_PATH or TOKENIZER_PATH) has no chat "
                         "template of its own; use TEMPLATE=builtin, none or a Jinja file")
    return tokenizer.chat_template


TEMPLATE = {
    "builtin": Template(
        lambda tok, template: None,
        lambda tok, conversation: builtin_segments(conversation),
        lambda tok: _marker_tokens(tok, f"{END_TOKEN}\n{ROLE_TOKENS['assistant']}\n"),
        checks_markers=True,
    ),
    "tokenizer": Template(
        _own, template_segments, _own_marker, own_markup=True, why="the tokenizer's own chat template"
    ),
    "file": Template(
        lambda tok, path: read_template(tok, path), template_segments, _own_marker, own_markup=True
    ),
    # final/ of a causal LM prompts as trained: the raw source + eos (RAW_CHAT_TEMPLATE)
    "none": Template(
        lambda tok, template: None,
        _raw_segments,
        lambda tok: 1 if tok.eos_token_id is not None else 0,
        builtin_fills=False,
        raw=True,
        final=raw_template,
    ),
}
NAMES = templates.TEMPLATES  # TEMPLATE's words (config.py checks the same; a test holds them to the table)


def named(template: str) -> Template:
    """The entry of a TEMPLATE value that is set: a word of NAMES, else a Jinja file."""
    return TEMPLATE[template if template in NAMES else "file"]


def ensure_special_tokens(tokenizer, template: str | None = None) -> int:
    """Make the tokenizer ready for SFT under TEMPLATE; returns how many tokens were added to its
    vocabulary (the caller resizes the model's embeddings when it is > 0). Safe to call twice.

    The entry sets the chat template: builtin (or empty, where the tokenizer has no template of
    its own) the built-in template's markers as special tokens (never split, one id each) and
    BUILTIN_CHAT_TEMPLATE; tokenizer its own, refused where it has none; a file its text; none no
    chat template at all (final/ then says so to generate). A pad token is set in any case: the
    eos token when there is one (padding is masked out by attention_mask and labels, so sharing
    the id costs nothing), else a new <|pad|>.
    """
    entry = named(template) if template else TEMPLATE["tokenizer"]  # empty: the tokenizer's own, if any
    tokenizer.chat_template = entry.chat_template(tokenizer, template)
    added = 0
    if entry.builtin_fills and is_builtin(tokenizer):
        added += tokenizer.add_special_tokens(
            {"additional_special_tokens": MARKERS}, replace_extra_special_tokens=False
        )
        tokenizer.chat_template = BUILTIN_CHAT_TEMPLATE
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is not None:
            tokenizer.pad_token = tokenizer.eos_token
        else:
            added += tokenizer.add_special_tokens({"pad_token": PAD_TOKEN})
    return added


def template_decision(d, tok, layout, say, decide) -> None:
    """TEMPLATE as the run renders it (a decision where it was left empty), LOSS_ON=all refused for an
    encoder-decoder, TEMPLATE=none's Jinja twin on a causal LM's tokenizer (saved with final/), and a note
    where the template saved with final/ has no {% generation %} markers. Both doors decide it."""
    layout.causal_only(d.loss_on == "all", "LOSS_ON=all: an encoder-decoder trains its target only (the "
                       "source is read, not predicted); leave LOSS_ON empty")
    mode = templates.Rendering.of(d).mode(tok)
    entry = TEMPLATE[mode]
    final = layout.pick(entry.final, None)  # an encoder-decoder's final/ prompts with the raw source + eos
    if final is not None:  # final/ then prompts as trained
        tok.chat_template = final(tok)
    if not d.template:
        decide("template", mode, f"TEMPLATE empty: {entry.why}")
    if entry.own_markup and not templates.has_generation_markers(tok.chat_template):
        say("note: the chat template saved with final/ has no {% generation %} markers, so transformers' "
            "return_assistant_tokens_mask and TRL's assistant_only_loss cannot use it (TEMPLATE=builtin has "
            "them)")
