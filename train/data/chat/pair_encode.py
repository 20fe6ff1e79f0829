"""Preference pairs -> token ids, rendered and tokenized by SFT's own code (TEMPLATE, REASONING, loss_weight).

A pair's prompt turns are rendered untrained (an assistant turn of the history gets loss_weight 0), each
side is the conversation prompt + reply, and:
- causal: both conversations go through encode.rendered_ids whole; the prompt is the ids the two share
  before the first trained token (the template's "reply now" marker included), and each side keeps its
  own ids after it, labels -100 where its turns are not trained (a tool result inside a reply, a turn of
  loss_weight 0). Example: {"prompt_ids", "chosen_ids", "chosen_labels", "rejected_ids", "rejected_labels"}.
- seq2seq (T5): both conversations go through encode.encode_pairs; the prompt is the encoder source
  (the same for both, with the tokenizer's own specials; TEMPLATE=none: the prompt + eos), each side the
  decoder target (the reply + eos, every token trained). A reply is one assistant turn here.

MAX_LENGTH holds the prompt with each reply: prompt + chosen and prompt + rejected (causal), the source
and each target (seq2seq). A pair too long loses prompt tokens first, cut once for both sides as SFT cuts
a source (TRUNCATION keep_end / keep_start; the tools list, system turn and reply marker always kept, the
prompt kept to at least MAX_LENGTH // 2 where it needs that much); then a reply still too long loses its
end, and that is counted apart (n_reply_cut): the log says so. A prompt whose kept part alone fills
MAX_LENGTH is a bad record.
"""

from __future__ import annotations

from collections.abc import Sequence

from train.core.errors import UsageError
from train.core.units import IGNORE_INDEX
from train.data.chat import templates
from train.data.chat.encode import encode_pairs, rendered_ids
from train.data.chat.template_table import TEMPLATE
from train.data.chat.templates import Rendering, Tally
from train.data.chat.turns import split_tools
from train.models.family import CAUSAL_LM

SIDES = ("chosen", "rejected")


def conversations(pair: dict) -> tuple[list[dict], list[dict]]:
    """(prompt + chosen, prompt + rejected), the prompt's assistant turns untrained."""
    prompt = [{**t, "loss_weight": 0.0} if t["role"] == "assistant" else t for t in pair["prompt"]]
    return prompt + pair["chosen"], prompt + pair["rejected"]


def _refuse(tally: Tally | None, index: int, reason: str) -> None:
    if tally is None:
        raise UsageError(f"DATA_PATH: a preference pair {reason}")
    tally.refuse(index, reason)


def _too_long(max_length: int) -> str:
    return (f"has a prompt that alone fills MAX_LENGTH={max_length} tokens (its tools list, system turn and "
            "reply marker, which truncation keeps; raise MAX_LENGTH if the model's context allows)")


def _first_trained(labels: list[int]) -> int:
    return next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), len(labels))


def _shared(a: list[int], b: list[int], limit: int) -> int:
    """How many leading ids a and b share, at most limit."""
    n = min(len(a), len(b), limit)
    return next((i for i in range(n) if a[i] != b[i]), n)


def fit(prompt: list[int], replies: list[tuple[list[int], list[int]]], pinned: int | None, max_length: int,
        truncation: str, marker: int):
    """(prompt, replies, prompt cut?, a reply cut?) with len(prompt) + len(reply) <= max_length for each
    reply, or None when the prompt cannot be cut that far (its pinned prefix and marker alone fill
    max_length; pinned None: a tools list whose extent is unknown)."""
    longest = max(len(ids) for ids, _ in replies)
    k = len(prompt)
    if k + longest <= max_length:
        return prompt, replies, False, False
    keep = min(k, max(max_length - longest, max_length // 2))
    if keep < k:  # the prompt gives way first, as SFT cuts a source, and for both sides alike
        if pinned is None or pinned + marker >= max_length:
            return None
        keep = max(keep, pinned + marker)
    prompt_cut = keep < k
    if prompt_cut:
        prompt = [prompt[i] for i in templates.kept_source(k, pinned, keep, truncation, marker)]
    room = max_length - len(prompt)
    return prompt, [(ids[:room], labels[:room]) for ids, labels in replies], prompt_cut, longest > room


def encode_causal(pairs: Sequence[dict], tokenizer, max_length: int, rendering: Rendering,
                  tally: Tally | None = None) -> tuple[list[dict], int, int]:
    """Pairs -> (examples, pairs truncated, pairs with a reply cut); see the module doc."""
    mode = rendering.mode(tokenizer)
    marker = TEMPLATE[mode].marker(tokenizer)
    # a side its chat template cannot render comes back None (counted here, by pair)
    whole = rendered_ids([c for pair in pairs for c in conversations(pair)], tokenizer, rendering, Tally(),
                                  max_length)
    examples, n_truncated, n_reply_cut = [], 0, 0
    for at, pair in enumerate(pairs):
        sides = next(whole), next(whole)
        if None in sides:  # a chat template that failed within its bound
            _refuse(tally, at, "its chat template did not render within the bound (time or size)")
            continue
        (ids_c, labels_c, pinned_c), (ids_r, labels_r, pinned_r) = sides
        firsts = _first_trained(labels_c), _first_trained(labels_r)
        if firsts[0] == len(labels_c) or firsts[1] == len(labels_r):
            _refuse(tally, at, "has a side with nothing to train (every assistant turn has loss_weight 0)")
            continue
        k = _shared(ids_c, ids_r, min(firsts))
        tools = split_tools(pair["prompt"])[0]
        pinned = min(pinned_c, pinned_r, k)
        replies = [(ids_c[k:], labels_c[k:]), (ids_r[k:], labels_r[k:])]
        fitted = fit(ids_c[:k], replies, None if tools and not pinned else pinned, max_length,
                     rendering.truncation, marker)
        if fitted is None:
            _refuse(tally, at, _too_long(max_length))
            continue
        prompt, replies, prompt_cut, reply_cut = fitted
        if any(labels.count(IGNORE_INDEX) == len(labels) for _, labels in replies):
            _refuse(tally, at, f"has a reply whose trained tokens start past MAX_LENGTH={max_length}")
            continue
        n_truncated, n_reply_cut = n_truncated + (prompt_cut or reply_cut), n_reply_cut + reply_cut
        if tally is not None and tools and prompt_cut:  # the history was cut, the tools list kept
            tally.tools_kept += 1
        example = {"prompt_ids": prompt}
        for side, (ids, labels) in zip(SIDES, replies, strict=True):
            example.update({f"{side}_ids": ids, f"{side}_labels": labels})
        examples.append(example)
    return examples, n_truncated, n_reply_cut


def _one_reply(pair: dict) -> str | None:
    for side in SIDES:
        if len(pair[side]) != 1:
            return (f"has a {side} reply of {len(pair[side])} turns: an encoder-decoder's target is one "
                    "assistant turn")
    return None


def encode_seq2seq(pairs: Sequence[dict], tokenizer, max_length: int, rendering: Rendering,
                   tally: Tally | None = None) -> tuple[list[dict], int, int]:
    """Pairs -> (examples, pairs truncated, pairs with a target cut) for an encoder-decoder: the source
    once, the two targets; see the module doc."""
    kept = []
    for at, pair in enumerate(pairs):
        if reason := _one_reply(pair):
            _refuse(tally, at, reason)
        else:
            kept.append(at)
    inner = Tally()
    encoded, _ = encode_pairs([c for at in kept for c in conversations(pairs[at])], tokenizer, max_length,
                                       rendering, inner)
    refused, cuts = dict(inner.refused), {i: (src, tgt) for i, src, tgt in inner.cut}
    produced = iter(encoded)  # one example per conversation encode_pairs did not refuse
    examples, n_truncated, n_reply_cut = [], 0, 0
    for j, at in enumerate(kept):
        sides = [None if i in refused else next(produced) for i in (2 * j, 2 * j + 1)]
        if None in sides:
            reason = refused.get(2 * j) or refused[2 * j + 1]
            _refuse(tally, at, _too_long(max_length) if "fill MAX_LENGTH" in reason else reason)
            continue
        chosen, rejected = sides
        if chosen["input_ids"] != rejected["input_ids"]:
            _refuse(tally, at, "is rendered with a different source before each reply (the chat template "
                    "renders the prompt differently; TEMPLATE=builtin does not)")
            continue
        cut = [cuts.get(i, (False, False)) for i in (2 * j, 2 * j + 1)]
        n_truncated += any(src or tgt for src, tgt in cut)
        n_reply_cut += any(tgt for _, tgt in cut)
        examples.append({"prompt_ids": chosen["input_ids"], "chosen_ids": chosen["labels"],
                         "chosen_labels": chosen["labels"], "rejected_ids": rejected["labels"],
                         "rejected_labels": rejected["labels"]})  # fmt: skip
    if tally is not None:
        tally.tools_kept += inner.tools_kept
    return examples, n_truncated, n_reply_cut


def encode(pairs: Sequence[dict], tokenizer, max_length: int, layout=CAUSAL_LM,
           rendering: Rendering | None = None, tally: Tally | None = None) -> tuple[list[dict], int, int]:
    """encode_causal, or encode_seq2seq for an encoder-decoder (the model's layout)."""
    rendering = rendering or Rendering()
    if rendering.loss_on == "all":
        raise UsageError("LOSS_ON=all: preference training scores the replies only (the prompt is the same "
                         "on both sides); leave LOSS_ON empty")
    fn = layout.pick(encode_causal, encode_seq2seq)
    return fn(pairs, tokenizer, max_length, rendering, tally)
