"""Scoring a batch of completions with several rewards at once, each call guarded.

A reward is called as TRL's GRPOTrainer calls one (trainer/grpo_trainer.py, _calculate_rewards), with
keyword arguments only: prompts, completions, completion_ids (each completion's token ids), the
data's extra columns as lists (one value per completion; `answer=[...]`), and TRL's extras:
trainer_state (a State: global_step and max_steps, the fields of TRL's TrainerState a reward reads
to shape itself by progress), log_metric(name, value) and log_extra(column, values) (kept in
RewardSet.logged: the log_metric values are each log line's metrics, named as logged, averaged over
the calls since the last line and every rank's as TRL averages them; the log_extra columns, TRL's
completions table's, are taken and not shown). TRL's `environments` (its tool-use environments) has no
counterpart here. A reward returns one float per completion, or None for a completion it does not
judge (TRL: NaN, left out of the weighted sum; a completion no reward judges has no reward at all).

Every call is guarded, because a reward is code the run does not control: one that raises, runs
past REWARD_TIMEOUT, returns another number of values than completions, a NaN or an infinity (None
says "skip"), or something not a number stops the run with one line naming the reward and what it
did (RewardFailed, a UsageError: exit code 2). The bound on time: each call runs in a daemon thread
and the caller waits REWARD_TIMEOUT for it. Python cannot stop a thread, so a call that hangs is
left behind: the run stops with the one line at once and the thread ends with the process (a
daemon thread does not hold the interpreter open). A thread per call costs about 0.3 ms (2,000 calls
of a trivial reward, 2 cores at load 13), nothing beside sampling the completions. A process per call
would cost a copy of every batch and of the function, which a closure or a file loaded by path
cannot always make.

The scores come back as a (completions, rewards) float32 tensor on the host, NaN where a reward said
None; RewardSet.combine weighs them by REWARD_WEIGHTS as TRL's default aggregation does (nansum over
the rewards; NaN where no reward judged the completion).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import threading
import traceback
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from train.core.errors import UsageError

DEFAULT_TIMEOUT = 60.0  # seconds one reward call may take (REWARD_TIMEOUT)
# The names every reward is called with: a data column of one of these names would collide.
REWARD_ARGS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


class RewardFailed(UsageError):
    """A reward that raised, hung or returned what is not one score per completion: one line."""


@dataclass(frozen=True)
class Reward:
    """One reward of REWARD_FUNCS: its name as REWARD_FUNCS gives it, the function, its REWARD_WEIGHTS
    weight, and the columns it needs (any one of them; a built-in's), checked before any work."""

    name: str
    fn: Callable
    weight: float = 1.0
    needs: tuple[str, ...] = ()


@dataclass(frozen=True)
class State:
    """What TRL's trainer_state offers a reward that shapes itself by progress."""

    global_step: int = 0
    max_steps: int = 0


@dataclass
class Logged:
    """What rewards logged through log_metric and log_extra since the last drain."""

    metrics: dict = field(default_factory=lambda: defaultdict(list))
    extra: dict = field(default_factory=lambda: defaultdict(list))

    def log_metric(self, name: str, value: float) -> None:
        self.metrics[str(name)].append(float(value))

    def log_extra(self, column: str, values: list) -> None:
        self.extra[str(column)].extend(values)

    def take_totals(self, names: list[str]) -> tuple[list[float], list[int]]:
        """Each named metric's (sum, count) of its values since the last take (0, 0 where it logged none);
        every metric emptied, the extra columns kept."""
        sums = [sum(self.metrics.get(n, ())) for n in names]
        counts = [len(self.metrics.get(n, ())) for n in names]
        self.metrics.clear()
        return sums, counts

    def drain(self) -> tuple[dict[str, float], dict[str, list]]:
        """(each metric's mean, the extra columns) since the last drain; both emptied."""
        means = {k: sum(v) / len(v) for k, v in self.metrics.items() if v}
        extra = dict(self.extra)
        self.metrics.clear()
        self.extra.clear()
        return means, extra


def _where(err: BaseException) -> str:
    """' (at file.py:12)': the innermost frame of the traceback, where the reward's own code failed."""
    frames = traceback.extract_tb(err.__traceback__)
    return f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""


def bounded(call: Callable[[], object], timeout: float, what: str) -> object:
    """call() in a daemon thread, awaited when it returns an awaitable (an async reward, as TRL runs
    them); RewardFailed naming `what` when it raises or runs past timeout seconds (module doc)."""
    box: dict = {}

    def run() -> None:
        try:
            out = call()
            box["out"] = asyncio.run(_awaited(out)) if inspect.isawaitable(out) else out
        except BaseException as err:  # SystemExit and KeyboardInterrupt of the reward's own too: said below
            box["err"] = err

    worker = threading.Thread(target=run, name=f"reward {what}", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise RewardFailed(
            f"REWARD_FUNCS: {what} did not return within REWARD_TIMEOUT={timeout:g} s (a loop "
            "without end, or a call that waits?); raise REWARD_TIMEOUT if it is only slow"
        )
    err = box.get("err")
    if isinstance(err, UsageError):  # already one line that names its knob (a built-in's)
        raise err
    if err is not None:
        first = (str(err).strip().splitlines() or [""])[0][:200]
        raise RewardFailed(
            f"REWARD_FUNCS: {what} raised {type(err).__name__}{': ' + first if first else ''}{_where(err)}"
        )
    return box.get("out")


async def _awaited(awaitable):
    return await awaitable


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def checked(name: str, out: object, n: int) -> list[float]:
    """A reward's answer -> n floats (NaN for None); RewardFailed naming the reward otherwise."""
    head = f"REWARD_FUNCS: reward {name!r} returned"
    if not isinstance(out, (list, tuple)) and callable(getattr(out, "tolist", None)):
        out = out.tolist()  # a numpy array or a tensor of scores
    if not isinstance(out, (list, tuple)):
        raise RewardFailed(
            f"{head} {type(out).__name__} {_short(out)}; a reward returns a list of {n} numbers, "
            "one per completion (None skips one)"
        )
    if len(out) != n:
        raise RewardFailed(
            f"{head} {len(out)} values for {n} completions; a reward returns one per completion "
            "(None skips one)"
        )
    values = []
    for i, value in enumerate(out):
        if value is None:
            values.append(math.nan)
            continue
        try:
            number = float(value) if not isinstance(value, (str, bytes)) else None
        except (TypeError, ValueError):
            number = None
        if number is None:
            raise RewardFailed(
                f"{head} {type(value).__name__} {_short(value)} at completion {i}, not a number "
                "(a reward's values are numbers, or None to skip a completion)"
            )
        if not math.isfinite(number) or abs(number) > FLOAT32_MAX:
            raise RewardFailed(
                f"{head} {value!r} at completion {i}: not a finite number (None skips a "
                "completion; NaN and infinities would spread through the advantages)"
            )
        values.append(number)
    return values


@dataclass
class RewardSet:
    """The rewards of one run (REWARD_FUNCS, REWARD_WEIGHTS, REWARD_TIMEOUT) and what they logged."""

    rewards: tuple[Reward, ...]
    timeout: float = DEFAULT_TIMEOUT
    logged: Logged = field(default_factory=Logged)

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.rewards]

    @property
    def weights(self) -> torch.Tensor:
        return torch.tensor([r.weight for r in self.rewards], dtype=torch.float32)

    def check_columns(self, columns: Iterable[str], source: str = "DATA_PATH") -> None:
        """Before any work: each built-in's column is in the data (one line naming it, and the source's
        variable, otherwise)."""
        have = set(columns)
        for reward in self.rewards:
            if reward.needs and not have.intersection(reward.needs):
                listed = ", ".join(sorted(have)) or "none besides the prompt"
                raise RewardFailed(
                    f"REWARD_FUNCS={reward.name}: {source} has no "
                    f"{' or '.join(map(repr, reward.needs))} column to compare the completions "
                    f"with (its columns: {listed})"
                )

    def score(
        self,
        prompts: Sequence,
        completions: Sequence,
        completion_ids: Sequence | None = None,
        columns: dict[str, Sequence] | None = None,
        state: State | None = None,
    ) -> torch.Tensor:
        """(len(completions), len(rewards)) float32 scores on the host, NaN where a reward said None.
        columns: the data's extra columns, a list each, one value per completion (a prompt's values
        repeated for each of its completions, as TRL repeats them)."""
        n = len(completions)
        columns = dict(columns or {})
        sizes = {
            "prompts": len(prompts),
            **({"completion_ids": len(completion_ids)} if completion_ids is not None else {}),
            **{k: len(v) for k, v in columns.items()},
        }
        if any(size != n for size in sizes.values()):  # the caller's mistake, not the user's
            raise ValueError(f"{n} completions but {sizes}")
        extras = {
            "trainer_state": state or State(),
            "log_extra": self.logged.log_extra,
            "log_metric": self.logged.log_metric,
        }
        scores = torch.empty(n, len(self.rewards), dtype=torch.float32)
        for j, reward in enumerate(self.rewards):
            # Fresh lists per reward: one that edits its arguments in place cannot change the next one's.
            kwargs = {
                "prompts": list(prompts),
                "completions": list(completions),
                "completion_ids": None if completion_ids is None else [list(ids) for ids in completion_ids],
                **{k: list(v) for k, v in columns.items()},
                **extras,
            }
            out = bounded(lambda fn=reward.fn, kw=kwargs: fn(**kw), self.timeout, f"reward {reward.name!r}")
            scores[:, j] = torch.tensor(checked(reward.name, out, n), dtype=torch.float32)
        return scores

    def combine(self, scores: torch.Tensor) -> torch.Tensor:
        """Each completion's reward: the weighted sum of its scores over the rewards that judged it
        (NaN ignored, as TRL's nansum); NaN where none did, for the caller to leave out of its group."""
        total = (scores * self.weights.to(scores.device)).nansum(dim=1)
        return total.masked_fill(torch.isnan(scores).all(dim=1), math.nan)
