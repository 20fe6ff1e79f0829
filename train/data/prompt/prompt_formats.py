"""Prompt records in the formats users already have -> Prompts; FORMATS holds a row per format.

Reward training needs only the prompt: the model writes the completions, the rewards judge them. A
Prompt carries three things: `prompt` as a reward function gets it (TRL's shape: a string where the
record gave a string, else a list of messages), `turns` as the chat template renders it (the one
conversation shape of train/data/sft/sft_turns.py, read through SFT's own readers, so typed content
parts, tool lists and system turns mean what they mean in SFT), and `columns`, every other column
of the record, handed to the rewards as keyword lists (`answer=[...]`), as TRL passes a dataset's
extra columns.

- prompt: TRL's prompt-only records: "prompt" a string (one user turn) or a list of messages ending
  where the reply starts (the user's turn, or a tool's result). A "completion" column is dropped, as
  TRL drops it from a reward's arguments.
- messages, conversations: a conversation (role/content, or ShareGPT's from/value; MiniMind's
  rlaif data). Trailing assistant turns are the reply, not the prompt: they are cut off (MiniMind
  cuts its last turn the same way), so SFT data serves as prompts too.
- alpaca: LLaMA-Factory's instruction (+ input, system, history), as SFT reads it.
The reply a record carries (alpaca's output, a conversation's last assistant turn) is also its
`answer` column where it has none, for the rewards that compare with one. A record with a column
named like a reward's own argument (REWARD_ARGS: completions, prompts ...) is a bad record, since
the two would collide in the call. Bad records stop the run in one line naming the file and the
line, or with SKIP_BAD_RECORDS=1 are skipped and counted, as SFT's and preference data's are.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from train.core.reward.guard import REWARD_ARGS
from train.data.chat import formats
from train.data.chat.turns import ROLE_NAMES, BadRecord, split_tools, text, turns

ANSWER = "answer"  # the column a record's own reply fills where it has none


@dataclass(frozen=True)
class Prompt:
    """One prompt: as rewards get it, as the template renders it, its other columns, where it came from."""

    prompt: str | list[dict]
    turns: list[dict]
    columns: dict = field(default_factory=dict)
    place: str = ""


@dataclass(frozen=True)
class Format:
    """One prompt format: a row of FORMATS. A new format is a new row."""

    name: str
    keys: str  # what its records carry, for "accepted: ..." messages
    detect: Callable[[dict], bool]
    convert: Callable[[dict], tuple[str | list[dict], list[dict], dict]]  # -> (prompt, turns, columns)
    uses: tuple[str, ...]  # the columns it reads; the rest go to the rewards


def _role(turn: object, role_key: str) -> str | None:
    if not isinstance(turn, dict):
        return None
    role = turn.get(role_key, turn.get("role", turn.get("from")))
    return ROLE_NAMES.get(role) if isinstance(role, str) else None


def _checked(conversation: list[dict], what: str) -> list[dict]:
    _, said = split_tools(conversation)
    if not any(t["role"] == "user" for t in said):
        raise BadRecord(f"no prompt ({what} has no user turn before the reply)")
    if said[-1]["role"] == "assistant":
        raise BadRecord(
            f"{what} ends with an assistant turn: a prompt ends where the reply starts (the "
            "user's turn, or a tool's result)"
        )
    return conversation


def _for_rewards(conversation: list[dict]) -> list[dict]:
    """A conversation as TRL's rewards get a conversational prompt: its messages, no tools entry."""
    return [dict(t) for t in split_tools(conversation)[1]]


def _answer(reply: object, what: str) -> dict:
    """{ANSWER: the reply's text} (to_prompt keeps a record's own answer over it), or {} for none."""
    if reply is None:
        return {}
    try:
        value = text(reply, what)
    except BadRecord:  # a reply of calls or reasoning parts: the prompt is still good, with no answer
        return {}
    return {ANSWER: value} if value.strip() else {}


def _prompt(record: dict) -> tuple[str | list[dict], list[dict], dict]:
    """TRL's prompt-only record: a string or a list of messages."""
    value = record["prompt"]
    if isinstance(value, list):
        conversation = _checked(turns(value, "role", "content", record.get("tools")), "'prompt'")
        return _for_rewards(conversation), conversation, {}
    value = text(value, "'prompt'")
    if not value.strip():
        raise BadRecord("'prompt' is empty")
    return value, turns([{"role": "user", "content": value}], "role", "content", record.get("tools")), {}


def _conversation(key: str, fmt: str) -> Callable:
    """A conversation under `key`, its trailing assistant turns (the reply) cut off."""

    def convert(record: dict) -> tuple[list[dict], list[dict], dict]:
        raw = record[key]
        role_key = "from" if fmt == "sharegpt" else "role"
        k = len(raw)
        while k and _role(raw[k - 1], role_key) == "assistant":
            k -= 1
        if k == 0:
            raise BadRecord(f"no prompt ({key!r} has no turn before the reply)")
        conversation = formats.FORMATS[fmt].convert({**record, key: raw[:k]}, "text")
        _checked(conversation, repr(key))
        reply = raw[-1].get("content", raw[-1].get("value")) if k < len(raw) else None
        return _for_rewards(conversation), conversation, _answer(reply, f"{key!r} reply")

    return convert


def _alpaca(record: dict) -> tuple[list[dict], list[dict], dict]:
    """LLaMA-Factory's alpaca: SFT's prompt of the record, without its reply."""
    conversation = formats.FORMATS["alpaca"].convert({**record, "output": ""}, "text")[:-1]
    return _for_rewards(conversation), conversation, _answer(record.get("output"), "'output'")


# Detected in this order: TRL's own first; a turn list before alpaca's fields, which it may also carry.
FORMATS = {
    f.name: f
    for f in (
        Format(
            "prompt",
            "prompt: a string or a list of messages (TRL prompt-only)",
            lambda r: "prompt" in r,
            _prompt,
            ("prompt", "completion", "tools"),
        ),
        Format(
            "messages",
            "messages: [{role, content}], a trailing assistant reply cut off",
            lambda r: isinstance(r.get("messages"), list),
            _conversation("messages", "messages"),
            ("messages", "tools", "system"),
        ),
        Format(
            "conversations",
            "conversations: [{from, value}] or [{role, content}] (ShareGPT, MiniMind)",
            lambda r: isinstance(r.get("conversations"), list),
            _conversation("conversations", "sharegpt"),
            ("conversations", "tools", "system"),
        ),
        Format(
            "alpaca",
            "instruction/input (LLaMA-Factory)",
            lambda r: "instruction" in r,
            _alpaca,
            ("instruction", "input", "system", "history"),
        ),
    )
}


accepted = partial(formats.listed, FORMATS)  # the formats, for "accepted: ..." messages
detect_format = partial(formats.first_match, FORMATS)  # the first format whose keys a record carries, or None


def to_prompt(record: dict, fmt: str, place: str = "") -> Prompt:
    """One record of format `fmt` -> a Prompt; a BadRecord says why not."""
    row = FORMATS[fmt]
    if detect_format(record) != fmt:
        keys = ", ".join(sorted(record)) if isinstance(record, dict) else type(record).__name__
        raise BadRecord(f"does not match the file's format {fmt} ({row.keys}); has: {keys}")
    clash = sorted(k for k in record if k in REWARD_ARGS)
    if clash:
        raise BadRecord(f"has a column {clash[0]!r}, the name of an argument every reward gets; rename it")
    prompt, conversation, found = row.convert(record)
    columns = {k: v for k, v in record.items() if k not in row.uses}
    for key, value in found.items():
        columns.setdefault(key, value)
    return Prompt(prompt, conversation, columns, place)


def open_prompts(
    data_path: str | Path, skip_bad_records: bool = True
) -> tuple[str, Iterator[tuple[str, object]]]:
    """(format name, every record of DATA_PATH as (place, record)), streamed through SFT's reader
    (JSON, JSONL(.gz), parquet, Arrow; a folder or glob of them); the format is the first matching
    record's. An empty source or an unknown format is one line naming DATA_PATH."""
    return formats.open_table(data_path, "prompt", FORMATS, skip_bad_records)


def converted(items, fmt: str) -> tuple[list[Prompt], list[str]]:
    """Records of format fmt -> (prompts, "place: reason" of each unusable record)."""
    prompts, bad = [], []
    for place, record in items:
        try:
            if isinstance(record, BadRecord):
                raise record
            prompts.append(to_prompt(record, fmt, place))
        except BadRecord as e:
            bad.append(f"{place}: {e}")
    return prompts, bad


def load_prompts(path: str | Path, skip_bad_records: bool = False) -> tuple[list[Prompt], str, int]:
    """DATA_PATH -> (prompts, format, records skipped), in memory (a prompt set is small: prompts
    only, no replies). A bad record stops with one line unless skip_bad_records; all bad stops too."""
    fmt, items = open_prompts(path, skip_bad_records)
    prompts, bad = converted(items, fmt)
    if bad and not skip_bad_records:
        raise formats.refuse_bad(bad[0])
    if not prompts:
        raise formats.all_bad(path, len(bad), bad[0])
    return prompts, fmt, len(bad)
