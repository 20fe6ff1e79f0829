"""The launcher variable of each config field and the value checks that name it: one line
naming the variable, exit code 2 (config.py's __post_init__ methods call these)."""

from __future__ import annotations

import glob
import math
from pathlib import Path

from train.core.errors import UsageError

# Launcher variable for a field, where it is not simply the field name in upper case.
ENV_NAMES = {
    "gradient_accumulation_steps": "GRADIENT_ACCUM",
    "gradient_checkpointing": "ENABLE_GRAD_CKPT",
}


def env_name(name: str) -> str:
    """The launcher variable for a config field (the README's knob table)."""
    return ENV_NAMES.get(name, name.upper())


def bad_value(name: str, accepted: str, value) -> UsageError:
    return UsageError(f"{env_name(name)} (--{name}): expected {accepted}, got {value!r}")


def check_int(obj, name: str, minimum: int, optional: bool = False) -> None:
    value = getattr(obj, name)
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise bad_value(name, f"a whole number >= {minimum}", value)


def check_float(obj, name: str, minimum: float, optional: bool = False, strict: bool = False) -> None:
    value = getattr(obj, name)
    if value is None and optional:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < minimum or (strict and value == minimum):
        raise bad_value(name, f"a number {'>' if strict else '>='} {minimum}", value)


def exists_or_matches(path: str) -> bool:
    """A file or folder that exists, or a glob pattern (*, ?, [) that matches something."""
    if any(c in path for c in "*?["):
        return bool(glob.glob(path, recursive=True))
    return Path(path).exists()
