"""SFT: conversations -> token ids with the loss mask -> batches that are mostly real tokens.

Loss only on what the assistant says. Each example carries labels = -100 on every system,
user and template-markup token and the token id on assistant content and the end-of-turn
token after it (the model learns to stop). Labels are not shifted here: transformers' causal
LM heads shift them by one inside the loss.

How the mask stays exact: a conversation is rendered to a list of segments (text, trained?)
whose concatenation is the full prompt string, and each segment is tokenized on its own and
the ids concatenated. A token therefore never straddles a masked/trained boundary, which a
"tokenize the whole string, then guess where the reply starts" approach cannot promise.
Segment boundaries fall on special tokens and newlines, where a byte-level BPE splits anyway,
so the ids equal those of the whole string in practice (the tests check it).

Two templates:
- the tokenizer's own chat template (tokenizer.chat_template set, e.g. a local instruct
  model): rendered with apply_chat_template; an assistant turn's characters are found by
  rendering the conversation up to that turn with the generation prompt (where the reply
  starts) and up to and including it (where it ends). Needs a template whose output for a
  prefix of the conversation is a prefix of the output for the whole; the common ones are.
  Tools go in as apply_chat_template's tools argument; a template that would drop the tools
  or the calls a conversation has is refused in one line.
- otherwise a built-in one, "<|user|>\\n...<|end|>\\n<|assistant|>\\n...<|end|>\\n", whose
  markers ensure_special_tokens adds; it also stores the same template as Jinja on the
  tokenizer, so runs/<name>/final/ works with apply_chat_template like any chat model. Tool
  calls: "<|tools|>\\n[schemas as JSON]<|end|>\\n" opens the conversation, an assistant's call
  is "<|tool_call|>{"name": ..., "arguments": ...}" inside its turn (after any text, before
  <|end|>, so it is trained), and a result is a "<|tool|>\\n...<|end|>\\n" turn (not trained).

An encoder-decoder (T5, BART) trains on source -> target pairs instead (encode_pairs): one pair
per assistant turn, the source everything the template renders before that reply, the target
the reply itself + eos.

Loading the formats and the built-in default data live in train/data/sft/sft_formats.py; padding and
batching (length grouping, token budgets, each rank's share) in train/data/sft/sft_batching.py.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence

from train.core.errors import UsageError
from train.core.units import IGNORE_INDEX
from train.data.sft.sft_batching import (
    LengthGroupedSampler,
    PadCollator,
    TokenBudgetBatchSampler,
    padding_efficiency,
)
from train.data.sft.sft_formats import builtin_conversations, load_conversations
from train.data.sft.sft_turns import call_text, split_tools

__all__ = [
    "IGNORE_INDEX",
    "BUILTIN_CHAT_TEMPLATE",
    "load_conversations",
    "builtin_conversations",
    "ensure_special_tokens",
    "render",
    "prompt_for_generation",
    "stop_token_ids",
    "encode_conversations",
    "encode_pairs",
    "encode",
    "PadCollator",
    "LengthGroupedSampler",
    "TokenBudgetBatchSampler",
    "padding_efficiency",
]

ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>", "tool": "<|tool|>"}
TOOLS_TOKEN = "<|tools|>"
TOOL_CALL_TOKEN = "<|tool_call|>"
END_TOKEN = "<|end|>"
PAD_TOKEN = "<|pad|>"
MARKERS = [ROLE_TOKENS["system"], ROLE_TOKENS["user"], ROLE_TOKENS["assistant"], END_TOKEN, TOOLS_TOKEN,
           TOOL_CALL_TOKEN, ROLE_TOKENS["tool"]]  # fmt: skip
# Jinja, for apply_chat_template on final/; _builtin_segments writes the same characters (a test
# holds them equal). No newline right after a block tag: transformers renders with trim_blocks.
BUILTIN_CHAT_TEMPLATE = (
    "{% if tools %}<|tools|>\n{{ tools | tojson }}<|end|>\n{% endif %}"
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] or '' }}"
    "{% for call in message['tool_calls'] or [] %}{% set f = call['function'] or call %}"
    "<|tool_call|>{{ {'name': f['name'], 'arguments': f['arguments']} | tojson }}{% endfor %}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# The template before tool calls: a tokenizer saved with it (an earlier SFT run's final/) is
# brought up to the current one by ensure_special_tokens.
_EARLIER_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_ENCODE_CHUNK = 1024  # conversations tokenized per call: batched calls are fast, and memory stays flat


def _builtin(tokenizer) -> bool:
    # The earlier template is not: a final/ saved with it has no tool markers, and its own
    # Jinja renders what it was trained on (until ensure_special_tokens brings it up to date).
    return tokenizer.chat_template is None or tokenizer.chat_template == BUILTIN_CHAT_TEMPLATE


def ensure_special_tokens(tokenizer) -> int:
    """Make the tokenizer ready for SFT; returns how many tokens were added to its vocabulary
    (the caller resizes the model's embeddings when it is > 0). Safe to call twice.

    Without a chat template of its own the tokenizer gets the built-in template's markers as
    special tokens (never split, one id each) and BUILTIN_CHAT_TEMPLATE. A pad token is set in
    any case: the eos token when there is one (padding is masked out by attention_mask and
    labels, so sharing the id costs nothing), else a new <|pad|>.
    """
    added = 0
    if _builtin(tokenizer) or tokenizer.chat_template == _EARLIER_TEMPLATE:
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


def _check_markers(tokenizer) -> None:
    # One id lookup, not get_vocab(): that builds a dict of the whole vocabulary per call, and
    # once per conversation it was most of SFT's start-up (a profile of 100k records).
    ids = tokenizer.convert_tokens_to_ids([END_TOKEN, TOOL_CALL_TOKEN])
    if any(i is None or i == tokenizer.unk_token_id for i in ids):
        # A programming error, not a user one: the markers would be split into ordinary tokens.
        raise RuntimeError(
            "call ensure_special_tokens(tokenizer) before rendering with the built-in template"
        )


def _builtin_segments(conversation: Sequence[dict]) -> list[tuple[str, bool]]:
    tools, turns = split_tools(conversation)
    segments: list[tuple[str, bool]] = []
    if tools:
        segments.append((f"{TOOLS_TOKEN}\n{json.dumps(tools, ensure_ascii=False)}{END_TOKEN}\n", False))
    for turn in turns:
        calls = "".join(TOOL_CALL_TOKEN + call_text(call) for call in turn.get("tool_calls") or ())
        segments += [
            (f"{ROLE_TOKENS[turn['role']]}\n", False),
            (turn["content"] + calls + END_TOKEN, turn["role"] == "assistant"),
            ("\n", False),
        ]
    return segments


def _apply(tokenizer, conversation: Sequence[dict], generation_prompt: bool, tools: list | None = None) -> str:
    try:
        return tokenizer.apply_chat_template(
            list(conversation), tools=tools or None, tokenize=False, add_generation_prompt=generation_prompt
        )
    except Exception as e:  # jinja's TemplateError, e.g. a template that refuses system turns
        raise UsageError(f"the tokenizer's chat template cannot render a conversation: {e}") from None


@functools.lru_cache(maxsize=8)
def _template_takes(template: str) -> tuple[bool, bool]:
    """(uses the tools list, renders tool calls): read from the template's source once."""
    import jinja2
    from jinja2 import meta

    try:
        uses_tools = "tools" in meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateError:  # transformers' own tags ({% generation %}): the plain parser fails
        uses_tools = "tools" in template
    return uses_tools, "tool_calls" in template


def _refuse_dropped_tools(tokenizer, tools: list | None, turns: Sequence[dict]) -> None:
    # A template that ignores tools or calls would train on conversations with them silently
    # left out: the reply to an observation the model never saw a call for.
    has_calls = any(t.get("tool_calls") for t in turns)
    if not (tools or has_calls) or not isinstance(tokenizer.chat_template, str):
        return
    takes_tools, takes_calls = _template_takes(tokenizer.chat_template)
    missing = "the tools list" if tools and not takes_tools else ""
    if has_calls and not takes_calls:
        missing = missing or "tool calls"
    if missing:
        raise UsageError(
            f"the tokenizer's chat template does not render {missing}, which this data has; remove "
            "chat_template from tokenizer_config.json to use the built-in template, which does"
        )


def _template_segments(tokenizer, conversation: Sequence[dict]) -> list[tuple[str, bool]]:
    tools, conversation = split_tools(conversation)
    _refuse_dropped_tools(tokenizer, tools, conversation)
    full = _apply(tokenizer, conversation, False, tools)
    segments, pos = [], 0
    for i, turn in enumerate(conversation):
        if turn["role"] != "assistant":
            continue
        before = _apply(tokenizer, conversation[:i], True, tools) if i else ""
        through = _apply(tokenizer, conversation[: i + 1], False, tools)
        if not (full.startswith(before) and full.startswith(through) and pos <= len(before) < len(through)):
            raise UsageError(
                "the tokenizer's chat template renders earlier turns differently as the conversation grows, "
                "so the assistant replies cannot be located; remove chat_template from tokenizer_config.json "
                "to use the built-in template"
            )
        # Trailing newlines after the end-of-turn token are markup, not something to learn.
        end = max(len(through.rstrip()), len(before) + 1)
        segments += [(full[pos : len(before)], False), (full[len(before) : end], True)]
        pos = end
    segments.append((full[pos:], False))
    return segments


def render(tokenizer, conversation: Sequence[dict], checked: bool = False) -> list[tuple[str, bool]]:
    """A conversation -> segments (text, trained); "".join(texts) is the full prompt string and
    trained is True exactly on assistant content plus its end-of-turn marker. checked: the
    caller has run _check_markers for this tokenizer already (once per batch, not per turn)."""
    if _builtin(tokenizer):
        if not checked:
            _check_markers(tokenizer)
        segments = _builtin_segments(conversation)
    else:
        segments = _template_segments(tokenizer, conversation)
    merged: list[tuple[str, bool]] = []
    for text, trained in segments:
        # Neighbours with the same flag go in one piece: fewer tokenizer calls, same ids.
        if merged and merged[-1][1] == trained:
            merged[-1] = (merged[-1][0] + text, trained)
        elif text:
            merged.append((text, trained))
    return merged


def prompt_for_generation(tokenizer, conversation: Sequence[dict] | str) -> str:
    """The text up to where the assistant's reply starts, for `python -m train generate`.
    A plain string is taken as one user turn."""
    if isinstance(conversation, str):
        conversation = [{"role": "user", "content": conversation}]
    if _builtin(tokenizer):
        _check_markers(tokenizer)
        return "".join(text for text, _ in _builtin_segments(conversation)) + ROLE_TOKENS["assistant"] + "\n"
    tools, turns = split_tools(conversation)
    return _apply(tokenizer, turns, True, tools)


def stop_token_ids(tokenizer) -> list[int]:
    """Ids that end an assistant turn, for generate(eos_token_id=...)."""
    vocab = tokenizer.get_vocab()
    ids = [vocab[t] for t in (END_TOKEN, "<|im_end|>", "<|eot_id|>", "<end_of_turn>") if t in vocab]
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return list(dict.fromkeys(ids))


def _truncate(input_ids: list[int], labels: list[int], max_length: int) -> tuple[list[int], list[int]]:
    first = next(i for i, label in enumerate(labels) if label != IGNORE_INDEX)
    if first < max_length:
        return input_ids[:max_length], labels[:max_length]  # keep the start, as inference sees it
    # The prompt alone fills max_length: cutting the end would leave nothing to learn, so keep
    # the prompt's last half-window and the start of the reply.
    start = first - max_length // 2
    return input_ids[start : start + max_length], labels[start : start + max_length]


def _encode_pieces(tokenizer, pieces: list[str]) -> list[list[int]]:
    """Token ids of each piece, no special tokens added: the same ids as tokenizer(pieces), but
    straight from the Rust tokenizer where there is one, without transformers turning every
    encoding into a dict of lists (a quarter of the tokenizing time in a profile)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    encode = getattr(backend, "encode_batch_fast", None) or getattr(backend, "encode_batch", None)
    if encode is None:
        return tokenizer(pieces, add_special_tokens=False)["input_ids"]
    return [e.ids for e in encode(pieces, add_special_tokens=False)]


def encode_conversations(
    conversations: Sequence[Sequence[dict]], tokenizer, max_length: int
) -> tuple[list[dict], int]:
    """Conversations -> ([{"input_ids", "labels"}], number truncated to max_length).

    Every assistant turn of a multi-turn conversation is trained on. A conversation longer
    than max_length is cut, not dropped, and counted so the run can report it.
    """
    examples: list[dict] = []
    n_truncated = 0
    builtin = _builtin(tokenizer)
    if builtin:
        _check_markers(tokenizer)
    for lo in range(0, len(conversations), _ENCODE_CHUNK):
        rendered = [render(tokenizer, c, checked=builtin) for c in conversations[lo : lo + _ENCODE_CHUNK]]
        pieces = [text for segments in rendered for text, _ in segments]
        piece_ids = iter(_encode_pieces(tokenizer, pieces))
        for segments in rendered:
            input_ids: list[int] = []
            labels: list[int] = []
            for _, trained in segments:
                ids = list(next(piece_ids))
                input_ids += ids
                labels += ids if trained else [IGNORE_INDEX] * len(ids)
            if len(input_ids) > max_length:
                input_ids, labels = _truncate(input_ids, labels, max_length)
                n_truncated += 1
            examples.append({"input_ids": input_ids, "labels": labels})
    return examples, n_truncated


def _special_wrap(tokenizer) -> tuple[list[int], list[int]]:
    """(ids before, ids after) that tokenizer(text) puts around a text's own ids: T5's appends
    </s>, BART's wraps in <s> ... </s>, the kit's byte-level BPE adds none."""
    bare = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a")["input_ids"]
    at = next((i for i in range(len(full) - len(bare) + 1) if full[i : i + len(bare)] == bare), None)
    return ([], []) if at is None else (full[:at], full[at + len(bare) :])


def _fit_pair(source: list[int], target: list[int], wrap: tuple[list[int], list[int]], max_length: int):
    """(source, target, cut?) each at most max_length tokens. A long source keeps its END: the
    reply answers the last turns, and the assistant marker that says "reply now" is there; the
    system prompt and the oldest turns go first. A long target keeps its start (as inference
    writes it), without eos, since the reply did not end there."""
    before, after = wrap
    room = max(0, max_length - len(before) - len(after))
    cut = len(source) > room or len(target) > max_length
    return before + source[len(source) - min(room, len(source)) :] + after, target[:max_length], cut


def encode_pairs(conversations: Sequence[Sequence[dict]], tokenizer, max_length: int) -> tuple[list[dict], int]:
    """Conversations -> ([{"input_ids": source, "labels": target}], pairs truncated) for an
    encoder-decoder. One pair per assistant turn, so every reply is trained on as in the causal
    case: the source is everything the template renders before that reply (system, tools list,
    user turns, earlier replies, tool results, up to the assistant marker), with the special
    tokens the tokenizer itself adds (T5's </s>), so tokenizer(prompt) at inference gives the
    same ids; the target is the reply (its text and tool calls, without the template's
    end-of-turn marker) + eos. Every target token is a label."""
    if tokenizer.eos_token_id is None:
        raise UsageError("MODEL_PATH: the tokenizer has no eos token, which ends an encoder-decoder's target")
    builtin = _builtin(tokenizer)
    if builtin:
        _check_markers(tokenizer)
    wrap, stops, eos = _special_wrap(tokenizer), set(stop_token_ids(tokenizer)), tokenizer.eos_token_id
    examples: list[dict] = []
    n_truncated = 0
    for lo in range(0, len(conversations), _ENCODE_CHUNK):
        rendered = [render(tokenizer, c, checked=builtin) for c in conversations[lo : lo + _ENCODE_CHUNK]]
        piece_ids = iter(_encode_pieces(tokenizer, [text for segments in rendered for text, _ in segments]))
        for segments in rendered:
            context: list[int] = []
            for _, trained in segments:
                ids = list(next(piece_ids))
                if trained:
                    reply = ids
                    while reply and reply[-1] in stops:  # the template's end-of-turn: eos ends a target
                        reply = reply[:-1]
                    source, target, cut = _fit_pair(context, reply + [eos], wrap, max_length)
                    examples.append({"input_ids": source, "labels": target})
                    n_truncated += cut
                context += ids
    return examples, n_truncated


def encode(conversations: Sequence[Sequence[dict]], tokenizer, max_length: int, kind: str = "causal"):
    """encode_conversations for a causal LM, encode_pairs for an encoder-decoder ("seq2seq")."""
    fn = encode_pairs if kind == "seq2seq" else encode_conversations
    return fn(conversations, tokenizer, max_length)
