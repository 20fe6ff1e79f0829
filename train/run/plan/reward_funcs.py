"""REWARD_FUNCS resolved into the run's rewards (train/core/reward/guard.py's RewardSet).

REWARD_FUNCS is a comma-separated list; each item is a built-in named plainly (accuracy, exact,
format, length: train/core/reward/builtin.py) or the user's own as `file.py:function`, a function
(or any callable object) with TRL's reward signature, `fn(completions, prompts, **columns) ->
list[float | None]`, taking **kwargs for the arguments it does not read (the list in guard.py).
REWARD_WEIGHTS weighs them, one number each, in order (empty: 1 each); REWARD_TIMEOUT bounds each
call; REWARD_PATTERN and REWARD_LENGTH are the format and length built-ins' knobs. Left empty on the
built-in task (no DATA_PATH), REWARD_FUNCS is the task's own set and REWARD_PATTERN its answer shape
(TASK_REWARDS, TASK_PATTERN: train/data/prompt/arithmetic.py); on the user's data REWARD_FUNCS must
be given, and REWARD_PATTERN with format, since no reward fits every data.

A user's file is Python the run executes with the user's permissions, so it is run only because the
user named it on the command line or in a launcher variable: it is imported from that path alone,
once per file, under a module name of its own; nothing here looks for reward code in a data, model
or run folder, and a run that resumes must be told REWARD_FUNCS again rather than take a file named
by the run folder's config.json (user_files says which items are files, for that check). Importing
the file runs inside the same bound as a call (REWARD_TIMEOUT); what it raises is one line. Its
folder is not put on sys.path (a module there named like a library would shadow it): a file that
imports its neighbours needs their folder on PYTHONPATH.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from train.core.errors import UsageError
from train.core.reward.builtin import BUILTINS, Options
from train.core.reward.guard import DEFAULT_TIMEOUT, Reward, RewardFailed, RewardSet, bounded
from train.data.prompt.arithmetic import TASK_PATTERN, TASK_REWARDS


def _items(funcs: str) -> list[str]:
    items = [item.strip() for item in funcs.split(",")]
    if not all(items):
        raise UsageError(
            f"REWARD_FUNCS={funcs!r}: an empty name between commas; give names like accuracy,format "
            "or my_rewards.py:score"
        )
    seen = {item for item in items if items.count(item) > 1}
    if seen:
        raise UsageError(
            f"REWARD_FUNCS={funcs!r}: {sorted(seen)[0]} is named twice; REWARD_WEIGHTS weighs it"
        )
    return items


def is_user_file(item: str) -> bool:
    """`file.py:function` (a user's reward) rather than a built-in's name."""
    path, colon, _ = item.rpartition(":")
    return bool(colon) and path.endswith(".py")


def user_files(funcs: str | None) -> list[str]:
    """The items of REWARD_FUNCS that name a user's file: code a run must never take from a saved config."""
    items = [item.strip() for item in (funcs or "").split(",")]
    return [item for item in items if is_user_file(item)]


def _module_of(path: Path, timeout: float, loaded: dict):
    """The user's file imported once (its own module name, from its resolved path), bounded in time."""
    key = path.resolve()
    if key in loaded:
        return loaded[key]
    name = "kit_reward_" + hashlib.sha1(str(key).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, key)
    if spec is None or spec.loader is None:
        raise UsageError(f"REWARD_FUNCS: {path} cannot be imported as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look a class's module up by name

    def run() -> None:
        spec.loader.exec_module(module)

    try:
        bounded(run, timeout, f"importing {path}")
    except RewardFailed:
        sys.modules.pop(name, None)
        raise
    loaded[key] = module
    return module


def _user_reward(item: str, timeout: float, loaded: dict) -> Reward:
    file, _, attr = item.rpartition(":")
    path = Path(file).expanduser()
    if not path.is_file():
        raise UsageError(f"REWARD_FUNCS={item}: no such file: {path}")
    if not attr.isidentifier():
        raise UsageError(f"REWARD_FUNCS={item}: {attr!r} is not a Python name; give file.py:function")
    try:
        module = _module_of(path, timeout, loaded)
    except RewardFailed as err:
        raise RewardFailed(str(err).replace("REWARD_FUNCS:", f"REWARD_FUNCS={item}:", 1)) from None
    fn = getattr(module, attr, None)
    if fn is None:
        defined = sorted(
            k
            for k, v in vars(module).items()
            if callable(v) and not k.startswith("_") and getattr(v, "__module__", None) == module.__name__
        )
        raise UsageError(
            f"REWARD_FUNCS={item}: {path.name} has no {attr!r} (it defines: "
            f"{', '.join(defined) or 'no functions'})"
        )
    if isinstance(fn, type) or not callable(fn):
        what = "a class (name a function, or an instance)" if isinstance(fn, type) else type(fn).__name__
        raise UsageError(f"REWARD_FUNCS={item}: {attr} is {what}, not a reward function")
    return Reward(item, fn)


def weights_of(weights: str | Sequence[float] | None, names: list[str]) -> list[float]:
    """REWARD_WEIGHTS: one number per reward, in REWARD_FUNCS's order (empty: 1.0 each)."""
    if weights is None or (isinstance(weights, str) and not weights.strip()):
        return [1.0] * len(names)
    raw = weights.split(",") if isinstance(weights, str) else list(weights)
    try:
        out = [float(w) for w in raw]
    except (TypeError, ValueError):
        raise UsageError(
            f"REWARD_WEIGHTS={weights!r}: expected numbers separated by commas (e.g. 1,0.5)"
        ) from None
    if len(out) != len(names):
        raise UsageError(
            f"REWARD_WEIGHTS={weights!r}: {len(out)} weights for {len(names)} rewards "
            f"(REWARD_FUNCS={','.join(names)}); give one each, in that order"
        )
    if not all(math.isfinite(w) for w in out) or not any(out):
        raise UsageError(f"REWARD_WEIGHTS={weights!r}: each weight a finite number, not all of them 0")
    return out


def build_rewards(
    funcs: str | None,
    weights: str | Sequence[float] | None = None,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    pattern: str = "",
    length: int = 0,
    builtin_data: bool = False,
) -> RewardSet:
    """The RewardSet of REWARD_FUNCS (empty on the built-in task: TASK_REWARDS, TASK_PATTERN), REWARD_WEIGHTS,
    REWARD_TIMEOUT, REWARD_PATTERN and REWARD_LENGTH; a UsageError names the knob of anything wrong,
    before any work."""
    if not (timeout > 0 and math.isfinite(timeout)):
        raise UsageError(
            f"REWARD_TIMEOUT={timeout!r}: seconds a reward call may take, above 0 (default "
            f"{DEFAULT_TIMEOUT:g})"
        )
    if not (funcs or "").strip():
        if not builtin_data:
            raise UsageError(
                "REWARD_FUNCS: name the rewards for DATA_PATH: built-ins "
                f"({', '.join(BUILTINS)}) or your own as file.py:function"
            )
        funcs = TASK_REWARDS
    if builtin_data and not pattern:
        pattern = TASK_PATTERN
    items = _items(funcs)
    options, loaded, rewards = Options(pattern=pattern or "", length=length or 0), {}, []
    for item in items:
        if is_user_file(item):
            rewards.append(_user_reward(item, timeout, loaded))
        elif item in BUILTINS:
            row = BUILTINS[item]
            rewards.append(Reward(item, row.make(options), needs=row.needs))
        else:
            raise UsageError(
                f"REWARD_FUNCS: unknown reward {item!r}; built-ins: "
                f"{'; '.join(f'{b.name} ({b.doc})' for b in BUILTINS.values())}; your own: file.py:function"
            )
    scaled = weights_of(weights, items)
    return RewardSet(
        tuple(Reward(r.name, r.fn, w, r.needs) for r, w in zip(rewards, scaled, strict=True)),
        timeout=float(timeout),
    )
