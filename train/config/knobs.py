"""The user's config.py (the root file) as the layers above the run read it: a preset's values,
a knob's value or default by field name, its launcher variable. Tools go through here; below the
run, code is handed values, never the config module."""

from __future__ import annotations

import dataclasses

import config

env_name = config.env_name


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
