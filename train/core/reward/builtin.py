"""The built-in rewards, named plainly in REWARD_FUNCS (REWARD_FUNCS=accuracy,format): BUILTINS holds a
row per reward. Each row makes a function with TRL's reward signature,
`fn(completions, prompts, **columns) -> list[float | None]`, so the built-ins and a user's own rewards
are called alike (train/core/reward/guard.py).

A completion is what TRL hands a reward: a string where the prompt was a string, or a list of
messages ([{"role": "assistant", "content": ...}]) where the prompt was a conversation; the text read
here is the last message's content. The gold answer is the `answer` column, or TRL's `solution` where
the data has no `answer`; a sample whose gold answer cannot be read scores None (skipped, as TRL's
accuracy_reward skips an unparseable solution).

- exact: 1.0 when the completion is the answer, after both have their whitespace collapsed and their
  case folded ("  Paris " matches "paris"); else 0.0.
- accuracy: 1.0 when the last number in the completion equals the answer's number, else 0.0 (a
  completion with no number: 0.0). Numbers are read by NUMBER: an optional minus sign, digits
  with thousands separators ("1,234" is 1234; "3,4" is two numbers), an optional decimal part;
  what stands around a number is ignored, so units and currency pass ("$1,000", "5 km", "42%",
  "Answer: 7."). Fractions and exponents are not read ("1/2" is 1 and 2). The answer column may
  be a number or a string whose last number is read the same way (GSM8K's "... #### 72" is 72).
  Equal means within one part in a million of the answer (PRECISION).
- format: 1.0 when REWARD_PATTERN (a Python regular expression, searched with DOTALL so "." crosses
  lines) is found in the completion, else 0.0. Anchor it (\\A ... \\Z) to hold the whole completion.
  A format is the data's own, so there is no default: the built-in task brings its pattern
  (train/data/prompt/arithmetic.py), other data needs REWARD_PATTERN.
- length: how close the completion's token count is to REWARD_LENGTH: 1 - |n - target| / target,
  at least 0 (1.0 on target, 0.0 at twice the target or empty). Tokens are the completion_ids the
  trainer passes, so the count is the model's, as TRL's length rewards count.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from train.core.reward.guard import RewardFailed

# An optional minus (ASCII or U+2212) not glued to a digit before it ("3-4" is 3 and 4), then digits
# with thousands groups or plain, then an optional decimal part; never the tail of a longer number.
NUMBER = re.compile(r"(?:(?<![\d.])[-\u2212])?(?<![\d.])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?!\d)")
PRECISION = 1e-6  # "equal": within this share of the answer (at least this much absolutely)
GOLD_COLUMNS = ("answer", "solution")  # the gold answer: the kit's column, else TRL's


def completion_text(completion: object) -> str:
    """A completion as TRL hands it -> its text (a conversation's: the last message's content)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Sequence) and completion and isinstance(completion[-1], dict):
        content = completion[-1].get("content")
        return content if isinstance(content, str) else ""
    return ""


def last_number(text: str) -> float | None:
    """The last number written in text (module doc), or None."""
    found = NUMBER.findall(text)
    return float(found[-1].replace(",", "").replace("\u2212", "-")) if found else None


def gold_number(value: object) -> float | None:
    """A gold answer as a number: a number as it is, a string's last number; None if neither."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value) if math.isfinite(value) else None
    return last_number(value) if isinstance(value, str) else None


def same_number(a: float, b: float) -> bool:
    return abs(a - b) <= PRECISION * max(1.0, abs(b))


def _normal(text: str) -> str:
    return " ".join(text.split()).casefold()


def _gold(name: str, columns: dict) -> list:
    """The gold column a reward reads: `answer`, else TRL's `solution`."""
    for column in GOLD_COLUMNS:
        if columns.get(column) is not None:
            return columns[column]
    raise RewardFailed(
        f"REWARD_FUNCS={name}: the data has no {' or '.join(map(repr, GOLD_COLUMNS))} column "
        "to compare the completions with"
    )


def exact(completions: list, **columns) -> list[float | None]:
    """1.0 where the completion is the answer (whitespace collapsed, case folded), else 0.0."""
    gold = _gold("exact", columns)
    return [
        None if g is None else float(_normal(completion_text(c)) == _normal(str(g)))
        for c, g in zip(completions, gold, strict=True)
    ]


def accuracy(completions: list, **columns) -> list[float | None]:
    """1.0 where the completion's last number equals the answer's, 0.0 where not; None where the
    answer holds no number."""
    out: list[float | None] = []
    for completion, gold in zip(completions, _gold("accuracy", columns), strict=True):
        want = gold_number(gold)
        got = last_number(completion_text(completion)) if want is not None else None
        out.append(None if want is None else float(got is not None and same_number(got, want)))
    return out


def format_reward(pattern: str) -> Callable[..., list[float]]:
    """The format reward of one REWARD_PATTERN; RewardFailed names a bad or missing one."""
    if not pattern:
        raise RewardFailed(
            "REWARD_FUNCS=format needs REWARD_PATTERN, the regular expression a well-shaped "
            "completion matches (e.g. '\\A\\s*-?\\d+\\s*\\Z' for a number alone)"
        )
    try:
        compiled = re.compile(pattern, re.DOTALL)
    except re.error as err:
        raise RewardFailed(f"REWARD_PATTERN={pattern!r}: not a regular expression ({err})") from None

    def format(completions: list, **_) -> list[float]:  # noqa: A001 (named as REWARD_FUNCS names it)
        return [float(compiled.search(completion_text(c)) is not None) for c in completions]

    return format


def length_reward(target: int) -> Callable[..., list[float]]:
    """The length reward of one REWARD_LENGTH (tokens); RewardFailed where none is set."""
    if not target or target < 1:
        raise RewardFailed(
            f"REWARD_FUNCS=length needs REWARD_LENGTH, the target length in tokens (got {target!r})"
        )

    def length(completions: list, completion_ids: list | None = None, **_) -> list[float]:
        if completion_ids is None:
            raise RewardFailed("REWARD_FUNCS=length counts completion_ids, which this caller did not pass")
        return [max(0.0, 1.0 - abs(len(ids) - target) / target) for ids in completion_ids]

    return length


@dataclass(frozen=True)
class Options:
    """The knobs the built-ins read: REWARD_PATTERN and REWARD_LENGTH."""

    pattern: str = ""
    length: int = 0


@dataclass(frozen=True)
class Builtin:
    """One built-in reward: a row of BUILTINS. A new built-in is a new row."""

    name: str
    make: Callable[[Options], Callable]  # the knobs -> the reward function
    needs: tuple[str, ...] = ()  # columns it reads (any one of them), checked before any work
    doc: str = ""


BUILTINS = {
    b.name: b
    for b in (
        Builtin(
            "exact", lambda o: exact, GOLD_COLUMNS, "the completion is the answer (case and spacing aside)"
        ),
        Builtin(
            "accuracy", lambda o: accuracy, GOLD_COLUMNS, "the completion's last number equals the answer's"
        ),
        Builtin(
            "format", lambda o: format_reward(o.pattern), (), "REWARD_PATTERN is found in the completion"
        ),
        Builtin(
            "length", lambda o: length_reward(o.length), (), "the completion is REWARD_LENGTH tokens long"
        ),
    )
}
