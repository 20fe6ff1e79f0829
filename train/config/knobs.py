"""The user's config.py (the root file) as the layers above the run read it: a preset's values,
a knob's value or default by field name, its launcher variable, the fields a marker picks out and
the launchers' variable lists. Tools go through here; below the run, code is handed values,
never the config module."""

from __future__ import annotations

import dataclasses

import config
from train.core.checks import has_mark

env_name = config.env_name
# The guides' precision shorthands (flags.py's --fp16 / --bf16): launcher switches, not fields.
PRECISION_SWITCHES = ("ENABLE_FP16:--fp16", "ENABLE_BF16:--bf16")


def marked(mark: str) -> tuple[str, ...]:
    """The fields carrying a marker (train/core/checks.py MARKS), in config.py's order."""
    return tuple(
        f.name for klass in config.SECTIONS.values() for f in dataclasses.fields(klass) if has_mark(f, mark)
    )


def launcher_lists() -> tuple[list[str], list[str]]:
    """(value knobs, switch knobs) as scripts/common.sh reads them: VARIABLE:--flag each."""
    switches, command = marked("switch"), marked("command")
    values = [f"{env_name(n)}:--{n}" for n in config.FIELD_SECTION if n not in switches and n not in command]
    return values, [*PRECISION_SWITCHES, *(f"{env_name(n)}:--{n}" for n in switches)]


def print_launcher_lists() -> None:
    """Two lines for scripts/common.sh: the value knobs, then the switch knobs."""
    for items in launcher_lists():
        print(" ".join(items))


def preset(name: str) -> dict:
    """A named preset's settings (config.PRESETS), as a copy."""
    return dict(config.PRESETS[name])


def value(cfg, name: str):
    """A knob's value in a TrainConfig, by field name."""
    return getattr(getattr(cfg, config.FIELD_SECTION[name]), name)


def set_value(cfg, name: str, new) -> None:
    """Set a knob of a TrainConfig (a tool's own trial copy), by field name."""
    setattr(getattr(cfg, config.FIELD_SECTION[name]), name, new)


def default(name: str):
    """A knob's dataclass default (what config.py says with no preset and no variable)."""
    section = config.SECTIONS[config.FIELD_SECTION[name]]
    field = next(f for f in dataclasses.fields(section) if f.name == name)
    return field.default if field.default is not dataclasses.MISSING else field.default_factory()
