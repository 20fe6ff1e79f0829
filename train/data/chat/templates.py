"""SFT templates: which one renders a conversation (TEMPLATE), what of it is trained (LOSS_ON,
REASONING, a turn's loss_weight) and what a long example keeps (TRUNCATION).

TEMPLATE picks the rendering (Rendering.mode; each one's behaviour is its entry in
train/data/chat/template_table.py):
- builtin: "<|user|>\\n...<|end|>\\n<|assistant|>\\n...<|end|>\\n", whose markers
  ensure_special_tokens adds as special tokens; BUILTIN_CHAT_TEMPLATE is its Jinja twin, saved
  with final/, with the trained spans inside {% generation %} ... {% endgeneration %}, so
  transformers' apply_chat_template(return_assistant_tokens_mask=True) and TRL's
  assistant_only_loss mark exactly the tokens the kit trained.
- tokenizer: the tokenizer's own chat template (TEMPLATE=tokenizer insists on one; a Jinja file
  given as TEMPLATE becomes the tokenizer's template, saved with final/ as it is).
- none: raw text-to-text, as ChatLM-mini-Chinese trains: no role markers, the tokenizer's own
  specials. Causal: each run of non-assistant turns, their contents joined with newlines, + eos
  (not trained), then the reply + eos (trained); a one-turn record is source + eos, target +
  eos. Encoder-decoder: the encoder reads every earlier turn's content joined with newlines,
  as tokenizer(source) gives it (+ eos where the tokenizer adds none); the labels are the reply
  + eos. A tools list is its JSON on the first line; a call is its JSON on a line of the reply.
  A causal LM's final/ carries RAW_CHAT_TEMPLATE (its prompt: the source + eos); an
  encoder-decoder's none (inference feeds tokenizer(prompt) as it is).
Empty: the tokenizer's own template where it has one, else builtin.

A conversation of one turn of role "text" (TEXT_FIELD records) is a plain document under any
TEMPLATE: its text + eos, every token trained. An assistant turn's reasoning_content is its
thinking trace, rendered before its content ("<think>\\n...\\n</think>\\n" in the built-in
template and under none; the tokenizer's own template reads message.reasoning_content, as
Qwen3's does) and trained like it; REASONING=drop removes it first. A turn's loss_weight 0
renders an assistant turn without training it.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field

from train.core.errors import UsageError
from train.core.files import read_user_file
from train.core.units import IGNORE_INDEX
from train.data.chat.render_bounds import RenderFailed, render_chat
from train.data.chat.turns import call_text

# TEMPLATE's words; anything else is a Jinja file (template_table)
TEMPLATES = ("builtin", "tokenizer", "none")
TEXT_ROLE = "text"  # a plain document (TEXT_FIELD): formats' one-turn conversation
MASKED, TRAINED, PINNED = 0, 1, 2  # a segment's flag; PINNED: masked, and kept by truncation (tools, system)

ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>", "tool": "<|tool|>"}
TOOLS_TOKEN = "<|tools|>"
TOOL_CALL_TOKEN = "<|tool_call|>"
END_TOKEN = "<|end|>"
PAD_TOKEN = "<|pad|>"
MARKERS = [ROLE_TOKENS["system"], ROLE_TOKENS["user"], ROLE_TOKENS["assistant"], END_TOKEN, TOOLS_TOKEN,
           TOOL_CALL_TOKEN, ROLE_TOKENS["tool"]]  # fmt: skip
THINK = "<think>\n{}\n</think>\n"
# Jinja, for apply_chat_template on final/; template_table.builtin_segments writes the same characters
# (a test holds them equal). No newline right after a block tag: transformers renders with
# trim_blocks, hence {{ '\n' }}. The body is captured first and then emitted inside or outside
# {% generation %}: the tracker counts characters of the top-level output, not of a macro's.
BUILTIN_CHAT_TEMPLATE = (
    "{% if tools %}<|tools|>\n{{ tools | tojson }}<|end|>\n{% endif %}"
    "{% for message in messages %}<|{{ message['role'] }}|>\n{% set body %}"
    "{% if message['reasoning_content'] %}<think>\n{{ message['reasoning_content'] }}\n</think>\n{% endif %}"
    "{{ message['content'] or '' }}{% for call in message['tool_calls'] or [] %}{% set f = call['function'] "
    "or call %}"
    "<|tool_call|>{{ {'name': f['name'], 'arguments': f['arguments']} | tojson }}{% endfor %}<|end|>{% "
    "endset %}{% if message['role'] == 'assistant' and (message['loss_weight'] is not defined or "
    "message['loss_weight'] != 0) %}"
    "{% generation %}{{ body }}{% endgeneration %}{% else %}{{ body }}{% endif %}{{ '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# Templates an earlier SFT run's final/ was saved with: brought up to the current one by
# template_table.ensure_special_tokens (before tool calls; before reasoning and the generation markers).
EARLIER_TEMPLATES = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}",
    "{% if tools %}<|tools|>\n{{ tools | tojson }}<|end|>\n{% endif %}"
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] or '' }}"
    "{% for call in message['tool_calls'] or [] %}{% set f = call['function'] or call %}"
    "<|tool_call|>{{ {'name': f['name'], 'arguments': f['arguments']} | tojson }}{% endfor %}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}",
)
# TEMPLATE=none's Jinja twin for a causal LM's final/ (raw_segments writes the same characters; a test
# holds them equal): every turn before a reply a line, + eos, then the reply + eos inside
# {% generation %}; the generation prompt is the source + eos, what the model was trained to answer.
# An encoder-decoder's final/ gets none: its encoder reads tokenizer(prompt) as it is.
RAW_CHAT_TEMPLATE = (
    "{#- the kit's TEMPLATE=none (raw text-to-text) -#}{{ BOS }}"
    "{%- set ns = namespace(src=(tools | tojson) if tools else none) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'assistant' -%}"
    "{%- if ns.src is not none -%}{{ ns.src ~ eos_token }}{%- endif -%}{%- set ns.src = none -%}"
    "{%- set ns.text = m['content'] or '' -%}{%- for call in m['tool_calls'] or [] -%}"
    "{%- set f = call['function'] or call -%}{%- set c = {'name': f['name'], 'arguments': f['arguments']} | "
    "tojson -%}{%- set ns.text = (ns.text ~ '\n' ~ c) if ns.text else c -%}{%- endfor -%}"
    "{%- set body = ('<think>\n' ~ m['reasoning_content'] ~ '\n</think>\n' if m['reasoning_content'] else '')"
    " ~ ns.text ~ eos_token -%}"
    "{%- if m['loss_weight'] is not defined or m['loss_weight'] != 0 -%}{% generation %}{{ body }}{% "
    "endgeneration %}{%- else -%}{{ body }}{%- endif -%}"
    "{%- else -%}{%- set ns.src = m['content'] if ns.src is none else ns.src ~ '\n' ~ m['content'] -%}{%- "
    "endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt and ns.src is not none -%}{{ ns.src ~ eos_token }}{%- endif "
    "-%}"
)
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
_PROBE = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]


@dataclass(frozen=True)
class Rendering:
    """TEMPLATE, LOSS_ON, TRUNCATION and REASONING, resolved (empty -> the default)."""

    template: str | None = None
    loss_on: str = "assistant"
    truncation: str = "keep_end"
    reasoning: str = "keep"

    @classmethod
    def of(cls, d) -> Rendering:
        """From a data config section (config.py's DataConfig)."""
        return cls(
            d.template or None, d.loss_on or "assistant", d.truncation or "keep_end", d.reasoning or "keep"
        )

    def mode(self, tokenizer) -> str:
        """builtin | tokenizer | none: how this tokenizer renders (after ensure_special_tokens)."""
        if self.template == "none" or (
            not self.template and tokenizer.chat_template == raw_template(tokenizer)
        ):
            return "none"
        return "builtin" if is_builtin(tokenizer) else "tokenizer"

    def key(self) -> str:
        """What of it changes the ids, for the SFT cache's key (a file's text is the chat template)."""
        template = self.template if self.template in (None, *TEMPLATES) else "file"
        return (f"template={template} loss_on={self.loss_on} truncation={self.truncation} "
                f"reasoning={self.reasoning}")


DEFAULT = Rendering()


def is_builtin(tokenizer) -> bool:
    return tokenizer.chat_template is None or tokenizer.chat_template == BUILTIN_CHAT_TEMPLATE


def raw_template(tokenizer) -> str:
    """RAW_CHAT_TEMPLATE with what tokenizer(text) puts first (Llama's <s>) written in."""
    return RAW_CHAT_TEMPLATE.replace("{{ BOS }}", bos_text(tokenizer).replace("{", "{{ '{' }}"))


def has_generation_markers(template: str | None) -> bool:
    """{% generation %} in a chat template: transformers' assistant mask and TRL can use it."""
    return isinstance(template, str) and bool(_GENERATION.search(template))


def read_template(tokenizer, path: str) -> str:
    """TEMPLATE=<file>: its text, refused in one line when it cannot be read or rendered."""
    try:
        text = read_user_file(path, "TEMPLATE (--template)").decode("utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise UsageError(
            f"TEMPLATE (--template): cannot read {path}: {getattr(err, 'strerror', None) or err}"
        ) from None
    try:
        render_chat(tokenizer, _PROBE, template=text)
    except RenderFailed as err:  # jinja's TemplateSyntaxError, a raise_exception() of the template, a loop
        raise UsageError(f"TEMPLATE (--template): {path} does not render a user/assistant conversation: "
                         f"{err.reason}") from None
    return text


def prepared(conversation, r: Rendering):
    """The conversation as rendered: REASONING=drop removes every reasoning_content."""
    if r.reasoning != "drop" or not any("reasoning_content" in t for t in conversation):
        return conversation
    return [{k: v for k, v in t.items() if k != "reasoning_content"} for t in conversation]


def trained(turn: dict) -> bool:
    """An assistant turn whose loss_weight is not 0 (absent: 1)."""
    return turn["role"] == "assistant" and turn.get("loss_weight", 1) != 0


def think(turn: dict) -> str:
    return THINK.format(turn["reasoning_content"]) if turn.get("reasoning_content") else ""


def is_document(conversation) -> bool:
    return len(conversation) == 1 and conversation[0]["role"] == TEXT_ROLE


@functools.lru_cache(maxsize=8)
def _wrap(tokenizer) -> tuple[tuple[int, ...], tuple[int, ...]]:
    bare = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a")["input_ids"]
    at = next((i for i in range(len(full) - len(bare) + 1) if full[i : i + len(bare)] == bare), None)
    return ((), ()) if at is None else (tuple(full[:at]), tuple(full[at + len(bare) :]))


def special_wrap(tokenizer) -> tuple[list[int], list[int]]:
    """(ids before, ids after) that tokenizer(text) puts around a text's own ids: T5's appends
    </s>, BART's wraps in <s> ... </s>, Llama's starts with <s>, the kit's byte-level BPE adds none."""
    try:
        before, after = _wrap(tokenizer)
    except TypeError:  # an unhashable tokenizer: not cached
        before, after = _wrap.__wrapped__(tokenizer)
    return list(before), list(after)


def eos_text(tokenizer) -> str:
    if tokenizer.eos_token is None:
        raise UsageError("MODEL_PATH: the tokenizer has no eos token, which ends a raw (TEMPLATE=none) or "
                         "plain-text turn")
    return tokenizer.eos_token


def bos_text(tokenizer) -> str:
    """The text of what tokenizer(text) puts first (Llama's <s>), for a raw or plain-text sequence."""
    return "".join(tokenizer.convert_ids_to_tokens(special_wrap(tokenizer)[0]))


def raw_reply(turn: dict) -> str:
    calls = [call_text(c) for c in turn.get("tool_calls") or ()]
    return think(turn) + "\n".join(p for p in [turn.get("content") or "", *calls] if p)


def _head(turns, tools) -> tuple[list[str], int]:
    """(the tools list's JSON and the leading system turns' contents, turns they took)."""
    head = [json.dumps(tools, ensure_ascii=False)] if tools else []
    k = 0
    while k < len(turns) and turns[k]["role"] == "system":
        head.append(turns[k]["content"])
        k += 1
    return head, k


def raw_segments(turns, tools, eos: str, bos: str) -> list[tuple[str, int]]:
    """TEMPLATE=none, causal: (text, flag) segments; see the module doc."""
    head, k = _head(turns, tools)
    segments: list[tuple[str, int]] = []
    pending: list[str] = []
    for turn in turns[k:]:
        if turn["role"] != "assistant":
            pending.append(turn["content"])
            continue
        if head:  # the tools list and system prompt: truncation keeps them
            segments.append(("\n".join(head) + ("\n" if pending else eos), PINNED))
            head = []
        if pending:
            segments.append(("\n".join(pending) + eos, MASKED))
            pending = []
        segments.append((raw_reply(turn) + eos, TRAINED if trained(turn) else MASKED))
    if segments and bos:
        segments[0] = (bos + segments[0][0], segments[0][1])
    return segments


def raw_pairs(turns, tools) -> list[tuple[str, str, str, bool]]:
    """TEMPLATE=none, encoder-decoder: (pinned source text, the rest of the source, reply, trained)
    per assistant turn; the source is every earlier turn's content, a line each."""
    head, k = _head(turns, tools)
    pairs, history = [], []
    for turn in turns[k:]:
        if turn["role"] == "assistant":
            pinned = "\n".join(head) + ("\n" if head and history else "")
            pairs.append((pinned, "\n".join(history), raw_reply(turn), trained(turn)))
        history.append(raw_reply(turn) if turn["role"] == "assistant" else turn["content"])
    return pairs


@dataclass
class Tally:
    """What encoding did beside the examples: records whose history was cut with their tools list
    kept, the conversations refused ((index, reason): a skip-rules bad record), those that cannot
    fit MAX_LENGTH (unfit: (index, reason); skipped and counted, not bad input), and the
    encoder-decoder pairs cut ((index, source cut?, target cut?), as preference pairs count them)."""

    tools_kept: int = 0
    refused: list = field(default_factory=list)
    unfit: list = field(default_factory=list)
    cut: list = field(default_factory=list)

    def refuse(self, index: int, reason: str) -> None:
        self.refused.append((index, reason))


def _closed(order: list[int], labels: list[int], ends) -> list[int]:
    """Kept positions whose last one cuts a trained run short: that run's end-of-turn (eos, <|end|>;
    one of `ends`) takes the last place, so a cut reply still ends, as ChatLM's [EOS] does."""
    last = order[-1] if order else None
    if last is None or labels[last] == IGNORE_INDEX:
        return order
    end = last
    while end + 1 < len(labels) and labels[end + 1] != IGNORE_INDEX:
        end += 1
    return order[:-1] + [end] if end != last and labels[end] in ends else order


def cut_conversation(ids: list[int], labels: list[int], pinned: int | None, max_length: int, truncation: str,
                     marker: int = 0, ends=frozenset()):
    """A causal example cut to max_length, or None when it cannot be without losing the tools list.

    The first trained token inside the window: the tail goes (both modes). The prompt fills the
    window: max_length // 2 source tokens are kept (more where the pinned prefix, the tools list
    and system turn, needs them: always kept, and the `marker` tokens just before the reply, its
    "reply now" marker: always kept), then the start of the reply. keep_end takes the source's end
    (the turns the reply answers), keep_start its start. pinned None: a tools list whose extent is
    unknown, so a cut source is refused. A reply cut short keeps its end-of-turn token (`ends`: the
    tokenizer's stop ids) in its last place."""
    first = next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), len(labels))
    if first < max_length:
        order = list(range(max_length))
    elif pinned is None or pinned + marker >= max_length:
        return None
    else:
        keep = max(max_length // 2, pinned + marker)
        order = [
            *kept_source(first, pinned, keep, truncation, marker),
            *range(first, min(len(ids), first + max_length - keep)),
        ]
    order = _closed(order, labels, ends)
    return [ids[i] for i in order], [labels[i] for i in order]


def kept_source(first: int, pinned: int, keep: int, truncation: str, marker: int = 0) -> list[int]:
    """Which `keep` of a source's `first` tokens a cut keeps (their indices): the pinned prefix, the
    source's end (keep_end) or start (keep_start), and the `marker` tokens it ends with."""
    room = keep - pinned - marker
    middle = (
        range(first - marker - room, first - marker)
        if truncation == "keep_end"
        else range(pinned, pinned + room)
    )
    return [*range(pinned), *middle, *range(first - marker, first)]


def fit_pair(source: list[int], pinned: int | None, target: list[int], wrap, max_length: int, truncation: str,
             marker: int = 0):
    """(source, target, cut?) each at most max_length tokens, or None when the pinned prefix (tools
    list, system turn) alone overfills the source. A long source keeps its end (keep_end: the
    reply answers the last turns, and the "reply now" marker is there) or its start (keep_start,
    as ChatLM), and the pinned prefix in either case. A long target keeps its start (as inference
    writes it) and its last token, the eos (ChatLM's cut response keeps its [EOS]): a cut reply
    still ends."""
    before, after = wrap
    room = max(0, max_length - len(before) - len(after))
    cut = len(source) > room or len(target) > max_length
    if len(source) > room:
        if pinned is None or pinned + marker > room:
            return None
        # the start, and the marker the source ends with (its TEMPLATE entry's)
        if truncation == "keep_start":
            source = source[: room - marker] + source[len(source) - marker :]
        else:
            source = source[:pinned] + source[len(source) - (room - pinned) :]
    return (
        before + source + after,
        target if len(target) <= max_length else target[: max_length - 1] + target[-1:],
        cut,
    )
