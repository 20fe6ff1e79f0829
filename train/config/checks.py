"""The launcher variable of each config field and the value checks that name it: one line
naming the variable, exit code 2 (config.py's __post_init__ methods call these)."""

from __future__ import annotations

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
    parts = Path(path).parts
    first = next((i for i, part in enumerate(parts) if any(c in part for c in "*?[")), None)
    if first is None:
        return Path(path).exists()
    # pathlib's glob, not glob.glob: "**" does not follow links to folders, which through a
    # link to a parent made glob.glob walk forever.
    root = Path(*parts[:first]) if first else Path(".")
    return root.is_dir() and next(iter(root.glob("/".join(parts[first:]))), None) is not None
