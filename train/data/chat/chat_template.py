"""SFT with the tokenizer's own chat template (a local instruct model's, or a TEMPLATE file):
rendered with apply_chat_template. A trained assistant turn's characters run from where the
conversation up to that turn, rendered with the generation prompt, ends (where the reply starts)
to where the conversation up to and including it ends. The tools list and leading system turns
are found the same way, so truncation can keep them (train/data/chat/templates.py). A template
that would drop the tools, calls or reasoning a conversation has is refused in one line.

Rendering those two prefixes for every trained turn costs the square of the turns (a 2,000-turn
conversation ran past its render bound), so a conversation renders once more instead, each
message's content between two private-use characters: where the template writes each content.
The first trained turn of each kind (with or without tool calls, reasoning) is found by its
prefixes as before, which gives the markup the template writes before its content (inside the
reply) and after it (its end of turn); a later turn of the same kind with that same markup
around its content is placed from it, and the last trained turn is rendered by its prefixes too,
as a check that the markup holds to the end. A turn the markup does not fit (its reasoning,
its calls, a template that trims or rewrites contents) falls back to its prefixes, within the
conversation's render budget.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

from train.core.errors import UsageError
from train.data.chat import templates
from train.data.chat.render_bounds import Budget, RenderFailed, render_chat
from train.data.chat.templates import MASKED, PINNED, TRAINED
from train.data.chat.turns import split_tools


def apply(tokenizer, conversation: Sequence[dict], generation_prompt: bool, tools: list | None = None,
          budget: Budget | None = None) -> str:
    """apply_chat_template's text, bounded (render_bounds): RenderFailed when the template fails
    on it (a template that refuses system turns), loops or grows past the budget."""
    return render_chat(tokenizer, conversation, tools or None, generation_prompt, budget=budget)


@functools.lru_cache(maxsize=8)
def _template_takes(template: str) -> tuple[bool, bool, bool]:
    """(uses the tools list, renders tool calls, renders reasoning): read from the source once."""
    import jinja2
    from jinja2 import meta

    try:
        uses_tools = "tools" in meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateError:  # transformers' own tags ({% generation %}): the plain parser fails
        uses_tools = "tools" in template
    return uses_tools, "tool_calls" in template, "reasoning_content" in template


def _refuse_dropped(tokenizer, tools: list | None, turns: Sequence[dict]) -> None:
    # A template that ignores tools, calls or reasoning would train on conversations with them
    # silently left out: the reply to an observation the model never saw a call for.
    has_calls = any(t.get("tool_calls") for t in turns)
    has_reasoning = any(t.get("reasoning_content") for t in turns)
    if not (tools or has_calls or has_reasoning) or not isinstance(tokenizer.chat_template, str):
        return
    takes_tools, takes_calls, takes_reasoning = _template_takes(tokenizer.chat_template)
    missing = "the tools list" if tools and not takes_tools else ""
    if has_calls and not takes_calls:
        missing = missing or "tool calls"
    if has_reasoning and not takes_reasoning:
        missing = missing or "reasoning_content (REASONING=drop removes it)"
    if missing:
        raise UsageError(
            f"the tokenizer's chat template does not render {missing}, which this data has; set "
            f"TEMPLATE=builtin "
            "to use the built-in template, which does"
        )


def _pinned_chars(tokenizer, conversation: Sequence[dict], tools, full: str, budget: Budget) -> int | None:
    """Characters of the tools list and leading system turns as the template renders them; None
    where that prefix cannot be told (a template that will not render it alone)."""
    k = next((i for i, t in enumerate(conversation) if t["role"] != "system"), len(conversation))
    if not (tools or k):
        return 0
    try:
        head = apply(tokenizer, conversation[:k], False, tools, budget)
    except RenderFailed as err:
        if err.spent:  # the conversation's budget, not the template's refusal of a lone head
            raise
        return None
    return len(head) if head and full.startswith(head) else None


_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use characters around each content in the locating render
_MARKS = re.compile(f"[{_OPEN}{_CLOSE}]")
_UNSTABLE = ("the tokenizer's chat template renders earlier turns differently as the conversation grows, so "
             "the assistant replies cannot be located; set TEMPLATE=builtin to use the built-in template")


def _prefix_bounds(tokenizer, conversation, tools, full: str, i: int, budget: Budget) -> tuple[int, int]:
    """(where turn i's reply starts, where it ends) from the conversation's two prefixes."""
    before = apply(tokenizer, conversation[:i], True, tools, budget) if i else ""
    through = apply(tokenizer, conversation[: i + 1], False, tools, budget)
    if not (full.startswith(before) and full.startswith(through)):
        raise UsageError(_UNSTABLE)
    return len(before), len(through)


def _content_spans(
    tokenizer, conversation, tools, full: str, budget: Budget
) -> dict[int, tuple[int, int]] | None:
    """{turn: (start, end) of its content in full}, from one render with each content between
    _OPEN and _CLOSE; None where the marks change what the template writes (a template that
    trims or rewrites contents) or do not come back once each, in order."""
    if _OPEN in full or _CLOSE in full:
        return None
    marked = [{**t, "content": _OPEN + t["content"] + _CLOSE} if isinstance(t.get("content"), str) else t
              for t in conversation]  # fmt: skip
    text = apply(tokenizer, marked, False, tools, budget)
    if text.replace(_OPEN, "").replace(_CLOSE, "") != full:
        return None
    owners = [i for i, t in enumerate(conversation) if isinstance(t.get("content"), str)]
    marks = [(m.start(), m.group()) for m in _MARKS.finditer(text)]
    if len(marks) != 2 * len(owners) or any(ch != (_OPEN, _CLOSE)[k % 2] for k, (_, ch) in enumerate(marks)):
        return None
    # A mark's place in full: its place in the marked text less the marks before it.
    return {i: (marks[2 * k][0] - 2 * k, marks[2 * k + 1][0] - 2 * k - 1) for k, i in enumerate(owners)}


def _kind(turn: dict) -> tuple[bool, bool]:
    return bool(turn.get("tool_calls")), bool(turn.get("reasoning_content"))


def reply_bounds(tokenizer, conversation, tools, full: str, turns: list[int], budget: Budget,
                 per_turn: bool = False) -> dict[int, tuple[int, int]]:
    """{trained turn: (start, end) of its reply in full}, as _prefix_bounds gives them, from a
    bounded number of renders where the template's markup around each content is the same
    (module doc); per_turn: every turn by its prefixes (the square of the turns)."""
    exact = functools.partial(_prefix_bounds, tokenizer, conversation, tools, full, budget=budget)
    spans = (
        None if per_turn or len(turns) < 3 else _content_spans(tokenizer, conversation, tools, full, budget)
    )
    if spans is None:
        return {i: exact(i) for i in turns}
    learned: dict = {}  # kind -> (markup before the content, inside the reply; markup after it)
    bounds: dict[int, tuple[int, int]] = {}
    for i in turns:
        start, end = spans.get(i, (-1, -1))  # a reply of calls alone (no content): by its prefixes
        head, tail = learned.get(_kind(conversation[i]), (None, None)) if start >= 0 else (None, None)
        fits = head is not None and start >= len(head) and full.startswith(head, start - len(head)) \
            and full.startswith(tail, end)
        if fits and i != turns[-1]:
            bounds[i] = (start - len(head), end + len(tail))
            continue
        bounds[i] = exact(i)
        if fits and bounds[i] != (start - len(head), end + len(tail)):  # the markup changed by the end
            return {k: exact(k) for k in turns}
        before, through = bounds[i]
        if head is None and 0 <= before <= start <= end <= through:
            learned[_kind(conversation[i])] = (full[before:start], full[end:through])
    return bounds


def template_segments(
    tokenizer, conversation: Sequence[dict], per_turn: bool = False
) -> list[tuple[str, int]]:
    """The conversation's (text, flag) segments; RenderFailed (a bad record) when its renders fail
    or, all together, outgrow one Budget (render_bounds). per_turn: reply_bounds' per_turn."""
    tools, conversation = split_tools(conversation)
    _refuse_dropped(tokenizer, tools, conversation)
    budget = Budget.of(conversation, tools)
    full = apply(tokenizer, conversation, False, tools, budget)
    pinned = _pinned_chars(tokenizer, conversation, tools, full, budget)
    segments, pos = [], 0
    if pinned:
        segments, pos = [(full[:pinned], PINNED)], pinned
    turns = [i for i, turn in enumerate(conversation) if templates.trained(turn)]
    for before, through in reply_bounds(
        tokenizer, conversation, tools, full, turns, budget, per_turn
    ).values():
        if not pos <= before < through:
            raise UsageError(_UNSTABLE)
        # Trailing newlines after the end-of-turn token are markup, not something to learn.
        end = max(len(full[:through].rstrip()), before + 1)
        segments += [(full[pos:before], MASKED), (full[before:end], TRAINED)]
        pos = end
    segments.append((full[pos:], MASKED))
    return segments
