"""Preference records in the formats users already have -> pairs; FORMATS holds a row per format.

A pair is {"prompt": turns, "chosen": turns, "rejected": turns} in the one conversation shape of
train/data/chat/turns.py: the prompt is a conversation (the tools list first where the record has
one, a system turn, earlier turns), and each side is the assistant's reply to it: one assistant turn,
or several (a call, its result, the answer). Every convert reads the turns through SFT's own readers
(turns(), and the alpaca and sharegpt rows of SFT's FORMATS for the prompt), so typed content parts,
tool calls, reasoning and loss_weight mean here what they mean in SFT. Strings become a user turn
(the prompt) and an assistant turn (each reply); TEMPLATE renders them as it renders SFT's prompt /
completion records (TEMPLATE=none: the raw text, as ChatLM-mini-Chinese trains).

Where a record gives two whole conversations (TRL's implicit prompt, MiniMind's dpo.jsonl,
LLaMA-Factory v1's chosen_messages / rejected_messages), the prompt is their longest common prefix of
turns (of characters, for two strings, with TRL's rule that a space before the first difference starts
the replies). A record that is no pair (a side missing or empty, both sides the same, no shared prompt,
nothing trained on a side) is a BadRecord whose message the reader prefixes with the file and the line
or row (train/data/chat/formats.py's source_records).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from train.data.chat import formats
from train.data.chat.turns import BadRecord, text, turns

SIDES = ("chosen", "rejected")


@dataclass(frozen=True)
class Format:
    """One preference format: a row of FORMATS. A new format is a new row."""

    name: str
    keys: str  # what its records carry, for "accepted: ..." messages
    detect: Callable[[dict], bool]
    # record -> (prompt, chosen, rejected)
    convert: Callable[[dict], tuple[list[dict], list[dict], list[dict]]]


def _has_side(record: dict) -> bool:
    return any(side in record for side in SIDES)


def _missing(record: dict, side: str) -> None:
    if record.get(side) is None:
        raise BadRecord(f"no {side!r} reply (a preference pair has both 'chosen' and 'rejected')")


def _reply(record: dict, side: str, role_key: str = "role", content_key: str = "content") -> list[dict]:
    """One side: a string (one assistant turn), a message object (LLaMA-Factory's sharegpt ranking) or
    a list of messages."""
    _missing(record, side)
    value = record[side]
    if isinstance(value, str):
        if not value.strip():
            raise BadRecord(f"no response ({side!r} is empty)")
        return [{"role": "assistant", "content": value}]
    value = [value] if isinstance(value, dict) else value
    if not isinstance(value, list):
        raise BadRecord(f"{side!r} is {type(value).__name__}, expected a string or a list of messages")
    if not value:
        raise BadRecord(f"no response ({side!r} is an empty list)")
    return _turns(value, side, role_key, content_key)


def _turns(value: list, what: str, role_key: str, content_key: str, tools: object = None) -> list[dict]:
    try:
        return turns(value, role_key, content_key, tools)
    except BadRecord as err:
        raise BadRecord(f"{what!r}: {err}") from None


def _same(a: dict, b: dict) -> bool:
    """Two turns alike, their loss_weight aside (a prompt's weights do not count)."""
    return {k: v for k, v in a.items() if k != "loss_weight"} == {
        k: v for k, v in b.items() if k != "loss_weight"
    }


def split_shared(chosen: list[dict], rejected: list[dict]) -> tuple[list[dict], list[dict], list[dict]]:
    """Two whole conversations -> (their longest common prefix of turns, the rest of each)."""
    k = next(
        (i for i, (a, b) in enumerate(zip(chosen, rejected, strict=False)) if not _same(a, b)),
        min(len(chosen), len(rejected)),
    )
    return chosen[:k], chosen[k:], rejected[k:]


def split_text(chosen: str, rejected: str) -> tuple[str, str, str]:
    """Two strings -> (their common start, the rest of each), as TRL's extract_prompt cuts them: a
    space just before the first difference goes with the replies."""
    n = min(len(chosen), len(rejected))
    k = next((i for i in range(n) if chosen[i] != rejected[i]), n)
    if 0 < k < n and chosen[k - 1] == " ":
        k -= 1
    return chosen[:k], chosen[k:], rejected[k:]


def _implicit(record: dict) -> tuple[list[dict], list[dict], list[dict]]:
    """TRL's implicit prompt and MiniMind's dpo.jsonl: two whole conversations (or two strings)."""
    for side in SIDES:
        _missing(record, side)
    chosen, rejected = record["chosen"], record["rejected"]
    if isinstance(chosen, str) and isinstance(rejected, str):
        prompt, chosen, rejected = split_text(chosen, rejected)
        replies = [
            [{"role": "assistant", "content": reply}] if reply.strip() else [] for reply in (chosen, rejected)
        ]
        return [{"role": "user", "content": prompt}] if prompt.strip() else [], *replies
    if not (isinstance(chosen, list) and isinstance(rejected, list)):
        raise BadRecord(f"'chosen' is {type(chosen).__name__} and 'rejected' {type(rejected).__name__}: with "
                        f"no 'prompt', both are whole conversations (lists of messages) or both strings")
    tools = record.get("tools")
    return split_shared(_turns(chosen, "chosen", "role", "content", tools),
                        _turns(rejected, "rejected", "role", "content", tools))  # fmt: skip


def _messages_v1(record: dict) -> tuple[list[dict], list[dict], list[dict]]:
    """LLaMA-Factory v1: chosen_messages / rejected_messages, each a whole conversation of messages
    with typed content parts ({"type": "text", "value": ...}) and a loss_weight each."""
    sides = []
    for side in ("chosen_messages", "rejected_messages"):
        value = record.get(side)
        if not isinstance(value, list) or not value:
            raise BadRecord(f"no {side!r} (a list of messages; a v1 pair has both chosen_messages and "
                            "rejected_messages)")  # fmt: skip
        sides.append(_turns(value, side, "role", "content", record.get("tools")))
    return split_shared(*sides)


def _sharegpt(record: dict) -> tuple[list[dict], list[dict], list[dict]]:
    """LLaMA-Factory's sharegpt ranking data: the prompt's turns, then a reply message per side."""
    prompt = formats.FORMATS["sharegpt"].convert(record, "text")
    return prompt, _reply(record, "chosen", "from", "value"), _reply(record, "rejected", "from", "value")


def _alpaca(record: dict) -> tuple[list[dict], list[dict], list[dict]]:
    """LLaMA-Factory's alpaca ranking data: instruction (+ input, system, history) and two strings."""
    chosen, rejected = _reply(record, "chosen"), _reply(record, "rejected")
    # SFT's prompt, no reply
    prompt = formats.FORMATS["alpaca"].convert({**record, "output": ""}, "text")[:-1]
    return prompt, chosen, rejected


def _explicit(record: dict) -> tuple[list[dict], list[dict], list[dict]]:
    """TRL's prompt / chosen / rejected, standard (strings) or conversational (message lists); ChatLM's
    raw strings."""
    chosen, rejected = _reply(record, "chosen"), _reply(record, "rejected")
    prompt = record["prompt"]
    if isinstance(prompt, list):
        return _turns(prompt, "prompt", "role", "content", record.get("tools")), chosen, rejected
    return [{"role": "user", "content": text(prompt, "'prompt'")}], chosen, rejected


# Detected in this order: the named layouts first, since their records carry chosen / rejected too.
FORMATS = {
    f.name: f
    for f in (
        Format("chosen_messages", "chosen_messages/rejected_messages: whole conversations (LLaMA-Factory v1)",
               lambda r: "chosen_messages" in r or "rejected_messages" in r, _messages_v1),
        Format("sharegpt", "conversations: [{from, value}] + chosen/rejected: {from, value} (LLaMA-Factory)",
               lambda r: isinstance(r.get("conversations"), list) and _has_side(r), _sharegpt),
        Format("alpaca", "instruction/input + chosen/rejected strings (LLaMA-Factory)",
               lambda r: "instruction" in r and _has_side(r), _alpaca),
        Format("prompt", "prompt/chosen/rejected: strings or message lists (TRL, ChatLM)",
               lambda r: "prompt" in r and _has_side(r), _explicit),
        Format("implicit", "chosen/rejected: whole conversations or strings sharing their start (TRL "
               "implicit prompt, MiniMind dpo.jsonl)", _has_side, _implicit),
    )
}


accepted = partial(formats.listed, FORMATS)  # the formats, for "accepted: ..." messages
detect_format = partial(formats.first_match, FORMATS)  # the first format whose keys a record carries, or None


def _trained(turn: dict) -> bool:
    return turn["role"] == "assistant" and turn.get("loss_weight", 1) != 0


def _checked_reply(reply: list[dict], side: str) -> list[dict]:
    if not reply:
        raise BadRecord(f"no {side!r} reply of its own (it ends where the shared prompt ends)")
    if reply[0]["role"] != "assistant":
        raise BadRecord(f"the {side!r} reply starts with a {reply[0]['role']} turn: the two sides answer "
                        "different prompts (a reply is the assistant's)")  # fmt: skip
    if not any(_trained(turn) for turn in reply):
        raise BadRecord(f"nothing to train in {side!r} (every assistant turn has loss_weight 0)")
    reply = list(reply)
    while not _trained(reply[-1]):  # trailing turns the loss skips only cost tokens, as in SFT
        reply.pop()
    return reply


def to_pair(record: dict, fmt: str) -> dict:
    """One record of format `fmt` -> {"prompt", "chosen", "rejected"}; a BadRecord says why not."""
    row = FORMATS[fmt]
    if detect_format(record) != fmt:
        keys = ", ".join(sorted(record)) if isinstance(record, dict) else type(record).__name__
        raise BadRecord(f"does not match the file's format {fmt} ({row.keys}); has: {keys}")
    prompt, chosen, rejected = row.convert(record)
    if _same_turns(chosen, rejected):
        raise BadRecord("chosen and rejected are the same reply (a pair teaches nothing)")
    chosen, rejected = _checked_reply(chosen, "chosen"), _checked_reply(rejected, "rejected")
    if not any(turn["role"] != "tools" for turn in prompt):
        raise BadRecord("no prompt (the two sides share no turn before they part)")
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def _same_turns(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))


BUILTIN_NAME = "built-in (a standard-library function's body preferred over another function's)"


def builtin_pairs(limit: int | None = None) -> list[dict]:
    """The set DATA_PATH left empty trains on: SFT's built-in conversations (a standard-library
    function's signature and docstring -> its body), each with its own body chosen and the body of
    another function of the set rejected (a fixed derangement: the conversation `shift` places on),
    so a model learns to prefer the reply that answers its prompt. Deterministic and offline."""
    conversations = formats.builtin_conversations(limit)
    n, shift = len(conversations), max(1, len(conversations) // 3)
    pairs = []
    for i, (user, reply) in enumerate(conversations):
        other = conversations[(i + shift) % n][1]["content"] if n > 1 else ""
        if other and other != reply["content"]:
            pairs.append(
                {"prompt": [user], "chosen": [reply], "rejected": [{"role": "assistant", "content": other}]}
            )
    return pairs


def open_pairs(
    data_path: str | Path, skip_bad_records: bool = True
) -> tuple[str, Iterator[tuple[str, object]]]:
    """(format name, every record of DATA_PATH as (place, record)), streamed (formats.open_table); SFT's
    records are pointed to SFT's command."""
    def hint(first: dict | None) -> str:
        sft = first and formats.detect_format(first)
        return "; SFT data trains with `python -m train sft`" if sft else ""

    return formats.open_table(data_path, "preference", FORMATS, skip_bad_records, hint)


def converted(items, fmt: str) -> tuple[list[dict], list[str], list[str]]:
    """Records of format fmt -> (pairs, their places, "place: reason" of each unusable record)."""
    pairs, places, bad = [], [], []
    for place, record in items:
        try:
            if isinstance(record, BadRecord):
                raise record
            pairs.append(to_pair(record, fmt))
            places.append(place)
        except BadRecord as e:
            bad.append(f"{place}: {e}")
    return pairs, places, bad


def load_pairs(path: str | Path, skip_bad_records: bool = False) -> tuple[list[dict], str, int]:
    """DATA_PATH -> (pairs, format, records skipped), in memory: for small data and tests (a run
    reads through the preference cache, train/data/chat/pair_cache.py)."""
    fmt, items = open_pairs(path, skip_bad_records)
    pairs, _, bad = converted(items, fmt)
    if bad and not skip_bad_records:
        raise formats.refuse_bad(bad[0])
    if not pairs:
        raise formats.all_bad(path, len(bad), bad[0])
    return pairs, fmt, len(bad)
