"""Conversations -> token ids with the loss mask (SFT's examples; the preference pairs' through pair_encode).

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

Two ways to find the trained text (TEMPLATE, LOSS_ON, REASONING, loss_weight, TRUNCATION and
the raw TEMPLATE=none rendering live in train/data/chat/templates.py):
- the tokenizer's own chat template (tokenizer.chat_template set, e.g. a local instruct
  model, or a TEMPLATE file): rendered with apply_chat_template; an assistant turn's characters
  are found by rendering the conversation up to that turn with the generation prompt (where the
  reply starts) and up to and including it (where it ends), in a bounded number of renders, not
  two per turn (chat_template.py). Needs a template whose output for a prefix of the
  conversation is a prefix of the output for the whole; the common ones are.
  Tools go in as apply_chat_template's tools argument; a template that would drop the tools,
  the calls or the reasoning a conversation has is refused in one line.
- otherwise a built-in one, "<|user|>\\n...<|end|>\\n<|assistant|>\\n...<|end|>\\n", whose
  markers ensure_special_tokens adds; it also stores the same template as Jinja on the
  tokenizer, so runs/<name>/final/ works with apply_chat_template like any chat model. Tool
  calls: "<|tools|>\\n[schemas as JSON]<|end|>\\n" opens the conversation, an assistant's call
  is "<|tool_call|>{"name": ..., "arguments": ...}" inside its turn (after any text, before
  <|end|>, so it is trained), and a result is a "<|tool|>\\n...<|end|>\\n" turn (not trained).

An encoder-decoder (T5, BART) trains on source -> target pairs instead (encode_pairs): one pair
per assistant turn, the source everything the template renders before that reply, the target
the reply itself + eos.

Loading the formats and the built-in default data: formats.py; padding and batching: batching.py.
"""

from __future__ import annotations

from collections.abc import Sequence

from train.core.errors import UsageError
from train.core.units import IGNORE_INDEX
from train.data import tokenize
from train.data.chat import template_table, templates
from train.data.chat.batching import (
    LengthGroupedSampler,
    PadCollator,
    TokenBudgetBatchSampler,
    padding_efficiency,
)
from train.data.chat.chat_template import apply
from train.data.chat.formats import builtin_conversations, load_conversations
from train.data.chat.render_bounds import RenderFailed
from train.data.chat.template_table import TEMPLATE, builtin_segments, check_markers, ensure_special_tokens
from train.data.chat.templates import (
    BUILTIN_CHAT_TEMPLATE,
    DEFAULT,
    END_TOKEN,
    PINNED,
    ROLE_TOKENS,
    TOOL_CALL_TOKEN,
    TRAINED,
    Rendering,
    Tally,
    special_wrap,
)
from train.data.chat.templates import is_builtin as _builtin
from train.data.chat.turns import split_tools
from train.models.family import CAUSAL_LM

__all__ = [
    "IGNORE_INDEX",
    "BUILTIN_CHAT_TEMPLATE",
    "TOOL_CALL_TOKEN",
    "Rendering",
    "Tally",
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

_ENCODE_CHUNK = 1024  # conversations tokenized per call: batched calls are fast, and memory stays flat


def _segments(tokenizer, conversation: Sequence[dict], r: Rendering, mode: str) -> list[tuple[str, int]]:
    """(text, flag) segments, neighbours with the same flag merged (fewer tokenizer calls, same ids)."""
    if templates.is_document(conversation):
        doc = templates.bos_text(tokenizer) + conversation[0]["content"] + templates.eos_text(tokenizer)
        return [(doc, TRAINED)]
    segments = TEMPLATE[mode].segments(tokenizer, templates.prepared(conversation, r))
    # TRL's assistant_only_loss=False: the whole sequence (pad excluded by the collator)
    if r.loss_on == "all":
        segments = [(text, TRAINED) for text, _ in segments]
    merged: list[tuple[str, int]] = []
    for text, flag in segments:
        if merged and merged[-1][1] == flag:
            merged[-1] = (merged[-1][0] + text, flag)
        elif text:
            merged.append((text, flag))
    return merged


def render(tokenizer, conversation: Sequence[dict], checked: bool = False,
           rendering: Rendering = DEFAULT) -> list[tuple[str, bool]]:
    """A conversation -> segments (text, trained); "".join(texts) is the full prompt string and
    trained is True exactly on assistant content plus its end-of-turn marker (LOSS_ON=all: on
    everything). checked: the caller has run _check_markers for this tokenizer already (once per
    batch, not per turn)."""
    mode = rendering.mode(tokenizer)
    if TEMPLATE[mode].checks_markers and not checked:
        check_markers(tokenizer)
    merged: list[tuple[str, bool]] = []
    for text, flag in _segments(tokenizer, conversation, rendering, mode):
        if merged and merged[-1][1] == (flag == TRAINED):
            merged[-1] = (merged[-1][0] + text, flag == TRAINED)
        else:
            merged.append((text, flag == TRAINED))
    return merged


def prompt_for_generation(tokenizer, conversation: Sequence[dict] | str) -> str:
    """The text up to where the assistant's reply starts, for `python -m train generate`.
    A plain string is taken as one user turn. A tokenizer with neither a chat template nor the
    built-in one's markers (a pretraining run's) never learnt a chat: its plain_prompt."""
    if isinstance(conversation, str):
        conversation = [{"role": "user", "content": conversation}]
    if tokenizer.chat_template is None and not template_table.has_markers(tokenizer):
        return template_table.plain_prompt(conversation)
    if _builtin(tokenizer):
        check_markers(tokenizer)
        return "".join(text for text, _ in builtin_segments(conversation)) + ROLE_TOKENS["assistant"] + "\n"
    tools, turns = split_tools(conversation)
    return apply(tokenizer, turns, True, tools)


def stop_token_ids(tokenizer) -> list[int]:
    """Ids that end an assistant turn, for generate(eos_token_id=...)."""
    vocab = tokenizer.get_vocab()
    ids = [vocab[t] for t in (END_TOKEN, "<|im_end|>", "<|eot_id|>", "<end_of_turn>") if t in vocab]
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return list(dict.fromkeys(ids))


def _rendered(tokenizer, chunk, r: Rendering, mode: str, tally: Tally | None, first: int) -> list:
    """_segments of each conversation; None for one its chat template cannot render within the
    bound (render_bounds): a bad record, refused as SKIP_BAD_RECORDS says."""
    out = []
    for k, conversation in enumerate(chunk):
        try:
            out.append(_segments(tokenizer, conversation, r, mode))
        except RenderFailed as err:
            _refuse(tally, first + k, f"cannot be rendered by the chat template: {err.reason}")
            out.append(None)
    return out


def _refuse(tally: Tally | None, index: int, reason: str) -> None:
    if tally is None:
        raise UsageError(f"DATA_PATH: a conversation {reason}")
    tally.refuse(index, reason)


def _unfit(tally: Tally | None, index: int, conversation, pinned: int | None, max_length: int) -> None:
    """A conversation this model cannot take at MAX_LENGTH (its tools list or system turn alone
    fills it): not bad input, so counted in tally.unfit (the cache build skips it, and refuses
    only when most records are such); without a tally, one line. Names what takes the room."""
    tools, turns = split_tools(conversation)
    system = bool(turns) and turns[0]["role"] == "system"
    if pinned is None:
        reason = (f"is longer than MAX_LENGTH={max_length} tokens and has a tools list whose end the chat "
                  "template does not mark, so it cannot be cut without losing the tools")
    else:
        what = ("its tools list and system turn take" if tools and system else
                "its tools list alone takes" if tools else "its system turn alone takes")
        reason = (f"cannot fit MAX_LENGTH={max_length} tokens: {what} {pinned} tokens, leaving no room for a "
                  "reply (shorten it, or train a model with a longer context)")
    if tally is None:
        raise UsageError(f"DATA_PATH: a conversation {reason}")
    tally.unfit.append((index, reason))


def _prepare(tokenizer, r: Rendering) -> str:
    mode = r.mode(tokenizer)
    if TEMPLATE[mode].checks_markers:
        check_markers(tokenizer)
    return mode


def rendered_ids(conversations: Sequence[Sequence[dict]], tokenizer, rendering: Rendering = DEFAULT,
                 tally: Tally | None = None, max_length: int | None = None):
    """Per conversation, whole (before any cut): (input_ids, labels, pinned), pinned the tokens of its
    leading tools list and system turns, which truncation keeps; None for one whose chat template
    failed within its bound (a bad record, counted in `tally`); max_length: a piece longer than a cut
    keeps is encoded by its ends. encode_conversations cuts them to
    MAX_LENGTH; preference pairs (train/data/pref) cut a pair's two sequences together."""
    mode = _prepare(tokenizer, rendering)
    for lo in range(0, len(conversations), _ENCODE_CHUNK):
        rendered = _rendered(tokenizer, conversations[lo : lo + _ENCODE_CHUNK], rendering, mode, tally, lo)
        texts = [text for segments in rendered for text, _ in segments or ()]
        # a piece longer than a cut can keep is encoded by its two ends only (tokenize.encode_texts_bounded)
        piece_ids = iter(tokenize.encode_texts(tokenizer, texts) if max_length is None else
                         tokenize.encode_texts_bounded(tokenizer, texts, max_length))
        for segments in rendered:
            if segments is None:
                yield None
                continue
            input_ids: list[int] = []
            labels: list[int] = []
            pinned = 0
            for _, flag in segments:
                ids = list(next(piece_ids))
                pinned += len(ids) if flag == PINNED and len(input_ids) == pinned else 0
                input_ids += ids
                labels += ids if flag == TRAINED else [IGNORE_INDEX] * len(ids)
            yield input_ids, labels, pinned


def encode_conversations(
    conversations: Sequence[Sequence[dict]],
    tokenizer,
    max_length: int,
    rendering: Rendering = DEFAULT,
    tally: Tally | None = None,
) -> tuple[list[dict], int]:
    """Conversations -> ([{"input_ids", "labels"}], number truncated to max_length).

    Every trained assistant turn of a multi-turn conversation is trained on. A conversation
    longer than max_length is cut (templates.cut_conversation, TRUNCATION), not dropped, and
    counted so the run can report it. One that cannot be used (nothing trained, a tools list that
    alone overfills max_length) goes into tally.refused, or without a tally stops in one line.
    """
    r, examples, n_truncated = rendering, [], 0
    mode = _prepare(tokenizer, r)
    marker = TEMPLATE[mode].marker(tokenizer)  # the "reply now" marker every cut keeps
    ends = set(stop_token_ids(tokenizer))  # and a cut reply its end-of-turn
    whole = rendered_ids(conversations, tokenizer, r, tally, max_length)
    for at, (conversation, rendered) in enumerate(zip(conversations, whole, strict=True)):
        if rendered is None:  # its chat template failed within the bound: refused in _rendered
            continue
        input_ids, labels, pinned = rendered
        if labels.count(IGNORE_INDEX) == len(labels):
            _refuse(tally, at, "has nothing to train (every assistant turn has loss_weight 0)")
            continue
        if len(input_ids) > max_length:
            tools = split_tools(conversation)[0]
            known = None if tools and not pinned else pinned
            kept = templates.cut_conversation(
                input_ids, labels, known, max_length, r.truncation, marker, ends
            )
            if kept is None:
                _unfit(tally, at, conversation, known, max_length)
                continue
            n_truncated += 1
            if tally is not None and tools and kept[0] != input_ids[:max_length]:  # the history was cut
                tally.tools_kept += 1
            input_ids, labels = kept
        examples.append({"input_ids": input_ids, "labels": labels})
    return examples, n_truncated


def _raw_pairs(tokenizer, conversation: Sequence[dict], r: Rendering) -> list[tuple[str, str, str, bool]]:
    """(pinned source text, the rest of the source, reply, trained) of a plain document or under
    TEMPLATE=none."""
    if templates.is_document(conversation):
        return [("", "", conversation[0]["content"], True)]
    tools, turns = split_tools(templates.prepared(conversation, r))
    return templates.raw_pairs(turns, tools)


def _pairs_of(
    tokenizer,
    chunk,
    r: Rendering,
    mode: str,
    stops: set,
    max_length: int,
    tally: Tally | None = None,
    first: int = 0,
) -> list[tuple[list | None, bool]]:
    """Per conversation: (source ids without the tokenizer's specials, its pinned tokens, reply ids)
    per trained assistant turn, and whether it is raw (TEMPLATE=none or a plain document)."""
    raw = [TEMPLATE[mode].raw or templates.is_document(c) for c in chunk]
    texts = [
        _raw_pairs(tokenizer, c, r) if is_raw else _rendered(tokenizer, [c], r, mode, tally, first + k)[0]
        for k, (c, is_raw) in enumerate(zip(chunk, raw, strict=True))
    ]
    pieces = [t for items, is_raw in zip(texts, raw, strict=True) for item in items or ()
              for t in (item[:3] if is_raw else item[:1])]  # fmt: skip
    piece_ids = iter(tokenize.encode_texts_bounded(tokenizer, pieces, max_length))
    out = []
    for items, is_raw in zip(texts, raw, strict=True):
        if items is None:  # refused in _rendered
            out.append((None, False))
            continue
        pairs, context, pinned = [], [], 0
        for item in items:
            if is_raw:
                head, rest, reply = (list(next(piece_ids)) for _ in range(3))
                if item[3]:
                    pairs.append((head + rest, len(head), reply))
                continue
            ids = list(next(piece_ids))
            if item[1] == TRAINED:
                reply = ids
                while reply and reply[-1] in stops:  # the template's end-of-turn: eos ends a target
                    reply = reply[:-1]
                pairs.append((context, pinned, reply))
            pinned += len(ids) if item[1] == PINNED and len(context) == pinned else 0
            context = context + ids
        out.append((pairs, is_raw))
    return out


def encode_pairs(conversations: Sequence[Sequence[dict]], tokenizer, max_length: int,
                 rendering: Rendering = DEFAULT, tally: Tally | None = None) -> tuple[list[dict], int]:
    """Conversations -> ([{"input_ids": source, "labels": target}], pairs truncated) for an
    encoder-decoder. One pair per trained assistant turn, so every reply is trained on as in the
    causal case: the source is everything the template renders before that reply (system, tools
    list, user turns, earlier replies, tool results, up to the assistant marker; under
    TEMPLATE=none the earlier turns' contents, a line each), with the special tokens the
    tokenizer itself adds (T5's </s>; eos appended under none where it adds none), so
    tokenizer(prompt) at inference gives the same ids; the target is the reply (its reasoning,
    text and tool calls, without the template's end-of-turn marker) + eos. Every target token is
    a label. A source too long for max_length is cut by TRUNCATION (fit_pair), its tools list
    kept."""
    if tokenizer.eos_token_id is None:
        raise UsageError("MODEL_PATH: the tokenizer has no eos token, which ends an encoder-decoder's target")
    r = rendering
    if r.loss_on == "all":
        raise UsageError("LOSS_ON=all: an encoder-decoder trains its target only (the source is read, not "
                         "predicted); leave LOSS_ON empty")
    mode = _prepare(tokenizer, r)
    wrap, stops, eos = special_wrap(tokenizer), set(stop_token_ids(tokenizer)), tokenizer.eos_token_id
    raw_wrap = (wrap[0], wrap[1] if wrap[1][-1:] == [eos] else wrap[1] + [eos])  # raw: source + eos
    marker = 0 if TEMPLATE[mode].raw else TEMPLATE[mode].marker(tokenizer)  # raw: eos is in raw_wrap
    examples: list[dict] = []
    n_truncated = index = 0
    for lo in range(0, len(conversations), _ENCODE_CHUNK):
        chunk = conversations[lo : lo + _ENCODE_CHUNK]
        for conversation, (pairs, raw) in zip(
            chunk, _pairs_of(tokenizer, chunk, r, mode, stops, max_length, tally, lo), strict=True
        ):
            index, at = index + 1, index
            if pairs is None:  # refused in _rendered
                continue
            tools = split_tools(conversation)[0]
            sides = raw_wrap if raw else wrap
            fitted = [
                templates.fit_pair(
                    source,
                    None if tools and not pinned else pinned,
                    reply + [eos],
                    sides,
                    max_length,
                    r.truncation,
                    0 if raw else marker,
                )
                for source, pinned, reply in pairs
            ]
            if not pairs:
                _refuse(tally, at, "has nothing to train (every assistant turn has loss_weight 0)")
            elif None in fitted:
                pinned = pairs[fitted.index(None)][1]
                _unfit(tally, at, conversation, None if tools and not pinned else pinned, max_length)
            else:
                for (source, _, reply), (src, target, cut) in zip(pairs, fitted, strict=True):
                    examples.append({"input_ids": src, "labels": target})
                    n_truncated += cut
                    source_cut = len(src) < len(source) + len(sides[0]) + len(sides[1])
                    if tally is not None and cut:
                        tally.cut.append((at, source_cut, len(target) <= len(reply)))
                    if tally is not None and tools and source_cut:
                        tally.tools_kept += 1
    return examples, n_truncated


def encode(conversations: Sequence[Sequence[dict]], tokenizer, max_length: int, layout=CAUSAL_LM,
           rendering: Rendering = DEFAULT, tally: Tally | None = None):
    """encode_conversations for a causal LM, encode_pairs for an encoder-decoder (the model's layout)."""
    fn = layout.pick(encode_conversations, encode_pairs)
    return fn(conversations, tokenizer, max_length, rendering, tally)
