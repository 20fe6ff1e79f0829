"""SFT with the tokenizer's own chat template (a local instruct model's, or a TEMPLATE file):
rendered with apply_chat_template, and each trained assistant turn's characters found by
rendering the conversation up to that turn with the generation prompt (where the reply starts)
and up to and including it (where it ends). The tools list and leading system turns are found
the same way, so truncation can keep them (train/data/sft/templates.py). A template that would
drop the tools, calls or reasoning a conversation has is refused in one line.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from train.core.errors import UsageError
from train.data.sft import templates
from train.data.sft.render_bounds import Budget, RenderFailed, render_chat
from train.data.sft.sft_turns import split_tools
from train.data.sft.templates import MASKED, PINNED, TRAINED


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
            f"the tokenizer's chat template does not render {missing}, which this data has; set TEMPLATE=builtin "
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


def template_segments(tokenizer, conversation: Sequence[dict]) -> list[tuple[str, int]]:
    """The conversation's (text, flag) segments; RenderFailed (a bad record) when its renders fail
    or, all together, outgrow one Budget: each trained turn renders its prefix twice, so a
    conversation of very many turns costs the square of its length (render_bounds)."""
    tools, conversation = split_tools(conversation)
    _refuse_dropped(tokenizer, tools, conversation)
    budget = Budget.of(conversation, tools)
    full = apply(tokenizer, conversation, False, tools, budget)
    pinned = _pinned_chars(tokenizer, conversation, tools, full, budget)
    segments, pos = [], 0
    if pinned:
        segments, pos = [(full[:pinned], PINNED)], pinned
    for i, turn in enumerate(conversation):
        if not templates.trained(turn):
            continue
        before = apply(tokenizer, conversation[:i], True, tools, budget) if i else ""
        through = apply(tokenizer, conversation[: i + 1], False, tools, budget)
        if not (full.startswith(before) and full.startswith(through) and pos <= len(before) < len(through)):
            raise UsageError(
                "the tokenizer's chat template renders earlier turns differently as the conversation grows, "
                "so the assistant replies cannot be located; set TEMPLATE=builtin to use the built-in template"
            )
        # Trailing newlines after the end-of-turn token are markup, not something to learn.
        end = max(len(through.rstrip()), len(before) + 1)
        segments += [(full[pos : len(before)], MASKED), (full[len(before) : end], TRAINED)]
        pos = end
    segments.append((full[pos:], MASKED))
    return segments
