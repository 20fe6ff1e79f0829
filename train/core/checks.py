"""What the root config.py builds its fields with: the markers a field carries (knob), the
launcher variable of each field, and the value checks that name it (one line naming the
variable, exit code 2; config.py's __post_init__ methods call these). Here, below config.py, so
that imports run one way: core <- config.py <- train/config (flags, knobs)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from train.core.errors import UsageError

# A field's markers: the lists kept beside config.py (the launchers' variables, the flags that
# take "auto", the settings a resume compares) are derived from them (train/config/knobs.py), so a
# new knob is one field with its doc. Which modes read it is not a marker but knob(modes=...).
MARKS = {
    "auto": 'empty, "auto" or "none" leave it to the run (the field defaults to None)',
    "compared": "a RESUME=1 says so when it changed since the checkpoint",
    "switch": 'its launcher variable takes the guides\' switch form ("--flag", or 1/0)',
    "command": "set by the command or the launcher script itself: no launcher variable",
}


def knob(default=None, *marks: str, modes=None, least=None, above=None, below=None, choices: tuple = ()):
    """A config field with markers (MARKS) and its range: `warmup_steps: int | None = knob(None, "auto",
    "compared", least=0)`. modes: the modes that read it (config.py's groups, or a set of names); None:
    config.EVERY (train/config/knobs.py modes() reads it). least / above: the smallest value allowed / the
    bound it must exceed, checked by check_fields (int or float by the field's type; None allowed where
    the type allows it); below: the bound a float must stay under (DROPOUT < 1). choices: the accepted
    values of a text field (`choices=PRECISIONS`)."""
    unknown = set(marks) - set(MARKS)
    if unknown:  # a typo in config.py would otherwise drop the field from a list without a word
        raise ValueError(f"unknown knob marker(s) {sorted(unknown)}: expected {' | '.join(MARKS)} (the modes "
                         "that read it: modes={...})")
    if modes is not None and (isinstance(modes, str) or not modes
                              or not all(isinstance(m, str) for m in modes)):
        raise ValueError(f"knob modes: expected a set of mode names (modes={{'sft', 'dpo'}}), got {modes!r}")
    return dataclasses.field(
        default=default,
        metadata={
            "marks": frozenset(marks),
            "least": least,
            "above": above,
            "below": below,
            "choices": tuple(choices),
            "modes": None if modes is None else frozenset(modes),
        },
    )


def check_fields(obj) -> None:
    """Check every field of a config section that declares a range (knob(least= / above=)) or choices."""
    for f in dataclasses.fields(obj):
        choices, value = f.metadata.get("choices"), getattr(obj, f.name)
        if choices and not (value is None and "None" in str(f.type)) and value not in choices:
            raise bad_value(f.name, " | ".join(choices), value)
        least, above = f.metadata.get("least"), f.metadata.get("above")
        if least is None and above is None:
            continue
        optional = "None" in str(f.type)
        if str(f.type).startswith("int"):
            check_int(obj, f.name, least, optional)
        else:
            check_float(
                obj,
                f.name,
                above if above is not None else least,
                optional,
                strict=above is not None,
                below=f.metadata.get("below"),
            )


def has_mark(field: dataclasses.Field, mark: str) -> bool:
    return mark in field.metadata.get("marks", ())

# Launcher variable for a field, where it is not simply the field name in upper case (the
# guides' names; DESIGN's table). ENABLE_FP16 / ENABLE_BF16 are no fields: they set PRECISION.
ENV_NAMES = {
    "gradient_accumulation_steps": "GRADIENT_ACCUM",
    "gradient_checkpointing": "ENABLE_GRAD_CKPT",
}


def env_name(name: str) -> str:
    """The launcher variable for a config field (the knob tables of docs/knobs.md)."""
    return ENV_NAMES.get(name, name.upper())


def bad_value(name: str, accepted: str, value) -> UsageError:
    return UsageError(f"{env_name(name)} (--{name}): expected {accepted}, got {value!r}")


def check_int(obj, name: str, minimum: int, optional: bool = False, maximum: int | None = None,
              why: str = "") -> None:
    value = getattr(obj, name)
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise bad_value(name, f"a whole number >= {minimum}", value)
    if maximum is not None and value > maximum:
        raise bad_value(name, f"a whole number from {minimum} to {maximum}{why}", value)


def check_float(obj, name: str, minimum: float, optional: bool = False, strict: bool = False,
                below: float | None = None) -> None:
    value = getattr(obj, name)
    if value is None and optional:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if below is not None and not (ok and minimum <= value < below):
        raise bad_value(name, f"a number from {minimum:g} to below {below:g}", value)
    if not ok or value < minimum or (strict and value == minimum):
        raise bad_value(name, f"a number {'>' if strict else '>='} {minimum}", value)


def check_path(obj, name: str, what: str = "no such file or folder", test=None) -> None:
    """A path field that is set must pass `test` (default: exists_or_matches), else one line naming it."""
    value = getattr(obj, name)
    if value is not None and not (test or exists_or_matches)(value):
        raise UsageError(f"{env_name(name)} (--{name}): {what}: {value}")


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
