"""The user's config.py (the root file) as the layers above the run read it: a preset's values,
a knob's value or default by field name (a mode's own, config.MODE_DEFAULTS, where it has one), its
launcher variable, the fields a marker picks out, the modes that read a knob (its knob(modes=...),
the one place that says it: flags, checks, docs and launchers all ask modes() / applies()) and the
launchers' variable lists. Tools go through here; below the run, code is handed values, never the
config module."""

from __future__ import annotations

import dataclasses

import config
from train.core.checks import has_mark
from train.core.errors import UsageError

env_name = config.env_name
# The guides' precision shorthands (flags.py's --fp16 / --bf16): launcher switches, not fields.
PRECISION_SWITCHES = ("ENABLE_FP16:--fp16", "ENABLE_BF16:--bf16")


def marked(mark: str) -> tuple[str, ...]:
    """The fields carrying a marker (train/core/checks.py MARKS), in config.py's order."""
    return tuple(
        f.name for klass in config.SECTIONS.values() for f in dataclasses.fields(klass) if has_mark(f, mark)
    )


# What a mode is called where a knob is refused; a mode not named here is `python -m train MODE`.
MODE_NAMES = {
    "pretrain": "pretraining",
    "sft": "SFT",
    "dpo": "preference training",
    "grpo": "reward training",
}


def _field(name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(config.SECTIONS[config.FIELD_SECTION[name]]) if f.name == name)


def modes(name: str) -> frozenset:
    """The modes that read a knob: its knob(modes=...), else config.EVERY."""
    own = _field(name).metadata.get("modes")
    return frozenset(config.EVERY) if own is None else own


def applies(name: str, mode: str) -> bool:
    return mode in modes(name)


def _check_modes() -> None:
    """A mode misspelled in config.py's knob(modes=...) would leave the knob out of that mode without a
    word: stop at import instead (the launchers say it in one line: scripts/common.sh kit_knobs)."""
    for name in config.FIELD_SECTION:
        if unknown := modes(name) - set(config.MODES):
            raise ValueError(f"config.py: {name}'s knob(modes=...) names {sorted(unknown)}, not a mode of "
                             f"MODES ({' | '.join(config.MODES)})")


_check_modes()


def user_knobs() -> tuple[str, ...]:
    """Every field a user sets (launcher variable and flag): all but those marked "command"."""
    command = marked("command")
    return tuple(n for n in config.FIELD_SECTION if n not in command)


def mode_name(mode: str) -> str:
    return MODE_NAMES.get(mode, f"`python -m train {mode}`")


def readers(name: str) -> str:
    """The modes that read a knob, named, in config.MODES's order: "pretraining and SFT"."""
    names = [mode_name(m) for m in config.MODES if m in modes(name)]
    return ", ".join(names[:-1]) + f" and {names[-1]}" if len(names) > 1 else "".join(names)


def refusal(name: str, mode: str) -> str:
    """The line that stops a run of `mode` that does not read knob `name`, set (scripts/common.sh says the
    same of a launcher's variable, the launcher in place of the command)."""
    return (f"{env_name(name)} (--{name}) does not apply to {mode_name(mode)} (`python -m train {mode}`): "
            f"it is read by {readers(name)} only; leave it empty")


def refuse_unread(cfg) -> None:
    """A knob its mode (cfg.run.mode) does not read, set (not its default): one line naming it, before any
    work. The flags refuse one given at all (train/config/flags.py); this catches a config made in code."""
    mode = cfg.run.mode
    for name in user_knobs():
        if not applies(name, mode) and value(cfg, name) != default(name):
            raise UsageError(refusal(name, mode))


def launcher_lists() -> tuple[list[str], list[str]]:
    """(value knobs, switch knobs) as scripts/common.sh reads them: VARIABLE:--flag each."""
    switches, command = marked("switch"), marked("command")
    values = [f"{env_name(n)}:--{n}" for n in config.FIELD_SECTION if n not in switches and n not in command]
    return values, [*PRECISION_SWITCHES, *(f"{env_name(n)}:--{n}" for n in switches)]


def launcher_modes() -> tuple[list[str], list[str]]:
    """(VARIABLE:mode,mode for every knob some mode does not read, mode=its name for every mode) as
    scripts/common.sh reads them: a launcher refuses such a variable when its user sets it."""
    partial = [f"{env_name(n)}:{','.join(m for m in config.MODES if m in modes(n))}" for n in user_knobs()
               if set(config.MODES) - modes(n)]
    return partial, [f"{m}={mode_name(m)}" for m in config.MODES]


def print_launcher_lists() -> None:
    """Four lines for scripts/common.sh: the value knobs, the switch knobs, the knobs some mode does not
    read (with the modes that do), then the modes' names ("|" between them: a name has spaces)."""
    for items in launcher_lists():
        print(" ".join(items))
    partial, names = launcher_modes()
    print(" ".join(partial))
    print("|".join(names))


def preset(name: str) -> dict:
    """A named preset's settings (config.PRESETS), as a copy."""
    return dict(config.PRESETS[name])


def value(cfg, name: str):
    """A knob's value in a TrainConfig, by field name."""
    return getattr(getattr(cfg, config.FIELD_SECTION[name]), name)


def set_value(cfg, name: str, new) -> None:
    """Set a knob of a TrainConfig (a tool's own trial copy), by field name."""
    setattr(getattr(cfg, config.FIELD_SECTION[name]), name, new)


def default(name: str, mode: str | None = None):
    """A knob's default (what config.py says with no preset and no variable): `mode`'s own
    (config.MODE_DEFAULTS) where it has one, else the dataclass default."""
    own = config.MODE_DEFAULTS.get(mode, {})
    if name in own:
        return own[name]
    field = _field(name)
    return field.default if field.default is not dataclasses.MISSING else field.default_factory()
