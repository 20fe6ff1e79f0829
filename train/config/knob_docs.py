"""The knob documentation, generated from config.py: docs/knobs.md's tables and each launcher's
block of `VAR=${VAR:-default}  # what it does` lines (`python -m train knobs`). A knob is one field
with its docstring and markers; which launchers carry it follows from rules, not from lists:

- a launcher is a root *.sh that calls `kit_launch MODE PRESET` (its mode and preset read from it);
- a field carries a launcher variable unless it is marked "command" (set by the command itself);
- a field's knob(modes=...) (config.py's groups EVERY, FINE_TUNING ..., or a set) names the modes that
  read it: the launchers of those modes carry it, the others leave it out (their mode refuses it);
- a docstring sentence opening with a mode's name ("DPO: ...") starts what it says for that mode's
  launchers (their comment and "empty: ..."); the others read the text before it;
- a launcher's own defaults (`BATCH_SIZE=${BATCH_SIZE:-16}`) are read back from its block, so
  regenerating keeps them; comments, order and groups come from config.py.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import config
from train.config import knobs
from train.config.flags import field_docs
from train.core.checks import has_mark
from train.core.errors import UsageError

MD_BEGIN = "<!-- BEGIN knobs: generated from config.py by `make knobs`; edit the field docstrings there -->"
MD_END = "<!-- END knobs -->"
SH_BEGIN_PREFIX, MD_BEGIN_PREFIX = "# BEGIN knobs", "<!-- BEGIN knobs"
SH_BEGIN = ("# BEGIN knobs: generated from config.py by `make knobs` (defaults: edit them here; comments: "
            "config.py)")
SH_END = "# END knobs"
KNOB_LINE = re.compile(r"^([A-Z][A-Z0-9_]*)=\$\{\1:-([^}]*)\}")
LAUNCH = re.compile(r"^\s*kit_launch\s+([\w-]+)\s+([\w-]+)", re.M)
SECTION_TITLES = {
    "model": "model", "data": "data, tokenizer, data loading", "optim": "batch, learning rate, how long",
    "system": "precision, device, several GPUs", "run": "run folder, checkpoints, evaluation, logs",
}  # fmt: skip
# Launcher variables that are no config field: (variable, the field its line goes before, what it
# takes, what it does). The precision switches set PRECISION (knobs.PRECISION_SWITCHES);
# NPROC_PER_NODE is torchrun's (scripts/common.sh).
LAUNCHER_ONLY = (
    ("ENABLE_FP16", "precision", "`--fp16`, `1` or `0`", '"--fp16" (or 1): fp16 autocast + GradScaler'),
    ("ENABLE_BF16", "precision", "`--bf16`, `1` or `0`", '"--bf16" (or 1): bf16 autocast (Ampere+ GPUs, '
                                                         'modern CPUs)'),
    ("NPROC_PER_NODE", "sharding", "a whole number >= 1",
     "processes (GPUs) on this machine; above 1 starts torchrun (DDP): docs/multi-gpu.md"),
)
SENTENCE_END = re.compile(r"(?<!e\.g\.)(?<!i\.e\.)(?<=\.)\s+(?=\S)")
COMMENT_WIDTH = 120  # a launcher comment longer than this is cut at a clause


@dataclasses.dataclass(frozen=True)
class Knob:
    name: str  # the field
    section: str
    doc: str
    modes: frozenset  # the modes that read it (knobs.modes): the others refuse it
    default: object  # the dataclass default (a mode's own: knobs.default(name, mode))
    choices: tuple
    switch: bool  # its variable takes the guides' switch form ("--flag" or 1/0)


@dataclasses.dataclass(frozen=True)
class Launcher:
    path: Path
    mode: str
    preset: str


def all_knobs() -> list[Knob]:
    """Every field a user sets (not "command"), in config.py's order."""
    docs, found = field_docs(), []
    for section, klass in config.SECTIONS.items():
        for f in dataclasses.fields(klass):
            if has_mark(f, "command"):
                continue
            found.append(Knob(f.name, section, docs.get(f.name, ""), knobs.modes(f.name),
                              knobs.default(f.name), tuple(f.metadata.get("choices", ())),
                              has_mark(f, "switch")))
    return found


def launchers(kit: Path | None = None) -> list[Launcher]:
    """The root scripts that start a run (`kit_launch MODE PRESET`), by name."""
    found = []
    for path in sorted((kit or config.KIT_DIR).glob("*.sh")):
        match = LAUNCH.search(path.read_text())
        if match:
            found.append(Launcher(path, match.group(1), match.group(2)))
    return found


def applies(knob: Knob, mode: str) -> bool:
    return mode in knob.modes


def mode_doc(doc: str, mode: str | None) -> str:
    """The part of a docstring a mode's launcher reads: from its sentence opening "<MODE>: " up to
    another mode's; a mode without one (or None) reads the part before the first such sentence."""
    heads = tuple(f"{m.upper()}: " for m in config.MODES)
    parts: list[list[str]] = [[]]
    for sentence in _sentences(doc) if doc else []:
        if sentence.startswith(heads) and parts[-1]:
            parts.append([])
        parts[-1].append(sentence)
    own = next((p for p in parts if mode and p and p[0].startswith(f"{mode.upper()}: ")), parts[0])
    return " ".join(own)


def shown(value) -> str:
    """A default as a user would type it: 1/0 for switches, paths inside the kit relative to it."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, float):  # 6e-4 as written, not 0.0006; 100.0 as 100
        mantissa, _, exponent = f"{value:.3e}".partition("e")
        small = value and abs(value) < 1e-3
        return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}" if small else f"{value:g}"
    text = str(value)
    kit = str(config.KIT_DIR)
    return text.replace(kit + "/", "") if text.startswith(kit + "/") else text


def _sentences(doc: str) -> list[str]:
    return SENTENCE_END.split(doc)


def _clip(text: str) -> str:
    """The text up to COMMENT_WIDTH, cut at its last clause ("; ", ": ", ", ", " (") outside brackets."""
    if len(text) <= COMMENT_WIDTH:
        return text
    depth, cut = 0, None
    for i, ch in enumerate(text[:COMMENT_WIDTH]):
        if depth == 0 and any(text.startswith(mark, i) for mark in ("; ", ": ", ", ", " (")):
            cut = i
        depth += {"(": 1, ")": -1}.get(ch, 0)
    return text[:cut] if cut else text


def summary(knob: Knob, mode: str | None = None) -> str:
    """What it does, in a line: the first sentence of `mode`'s part of the docstring (mode_doc; a
    mode's own prefix "SFT: " dropped)."""
    doc = mode_doc(knob.doc, mode)
    first = _sentences(doc)[0] if doc else ""
    for m in {*knob.modes, *([mode] if mode else [])}:
        first = first.removeprefix(f"{m.upper()}: ")
    listed = " | ".join(knob.choices)
    if knob.choices and first.startswith(knob.choices[0]) and not first.startswith(listed):
        first = listed  # the choices, each explained: too long for a line, so their names
    if re.match(r"(?:[A-Z][a-z]+|A)\b", first):  # a sentence's capital, not a name (DataLoader, MB, JSONL)
        first = first[0].lower() + first[1:]
    if knob.switch:
        first = f'"--{knob.name}" (or 1): {first}'
    return _clip(first.rstrip("."))


def empty_means(knob: Knob, preset: str | None, mode: str | None = None) -> str:
    """What an empty variable gives ("empty: ..."): the preset's value, else config.py's default,
    else what `mode`'s part of its docstring says ("Empty: ..." / "Empty or 0: ..." / "keep_end (empty:
    ...)")."""
    values = config.PRESETS.get(preset, {}) if preset else {}
    if knob.name in values:
        return f"empty: {shown(values[knob.name])} (preset {preset})"
    value = knobs.default(knob.name, mode) if mode else knob.default
    if value is not None:
        return f"empty: {shown(value)}"
    doc = mode_doc(knob.doc, mode)
    said = next((s for s in _sentences(doc)[1:] if re.match(r"Empty\b[^:]*: ", s)), "") if doc else ""
    if said:
        return "e" + said[1:].rstrip(".")
    inline = re.search(r"(\w+) \(empty: ([^)]*)\)", doc)
    return f"empty: {inline.group(1)} ({inline.group(2)})" if inline else ""


# ---- launchers --------------------------------------------------------------------------------


def block_span(lines: list[str]) -> tuple[int, int] | None:
    """(first, last + 1) of the generated block: from its BEGIN line to its END line, or, in a
    launcher written before the markers, from the comment lines above its first knob line to its
    last knob line before `source .../common.sh`."""
    begin = next((i for i, line in enumerate(lines) if line.startswith(SH_BEGIN_PREFIX)), None)
    if begin is not None:
        end = next((i for i in range(begin, len(lines)) if lines[i].strip() == SH_END), None)
        if end is None:
            raise UsageError(f"'{SH_BEGIN_PREFIX}' without a '{SH_END}' line")
        return begin, end + 1
    top = next((i for i, line in enumerate(lines) if line.startswith("source ")), len(lines))
    knob_lines = [i for i in range(top) if KNOB_LINE.match(lines[i])]
    if not knob_lines:
        return None
    first = knob_lines[0]
    while first > 0 and (
        lines[first - 1].startswith(("#", "KIT_GIVEN="))
        and not lines[first - 1].startswith("#!")
        or not lines[first - 1]
        and first > 1
        and lines[first - 2].startswith("KIT_GIVEN=")
    ):
        first -= 1
    return first, knob_lines[-1] + 1


def launcher_defaults(lines: list[str]) -> dict[str, str]:
    """{VARIABLE: default} of the knob lines in the launcher's block."""
    span = block_span(lines)
    if span is None:
        return {}
    return {m.group(1): m.group(2) for line in lines[span[0]:span[1]] if (m := KNOB_LINE.match(line))}


def knob_line(variable: str, default: str, comment: str) -> str:
    code = f"{variable}=${{{variable}:-{default}}}"
    return f"{code:<39} # {comment}" if comment else code


# The variables set (not empty) before the defaults below, the user's own: with RESUME=1 the launcher
# passes only these, so a default of the launcher's never overrides the resumed run's own setting
# (scripts/common.sh kit_launch; train/run/guard/carry.py).
GIVEN_LINE = (
    '''KIT_GIVEN=" $(compgen -v | while read -r v; do [ -z "${!v:-}" ] || printf '%s ' "$v"; done)"'''
    "  # set before the defaults below: RESUME=1 keeps the run's own settings for the rest"
)


def launcher_block(launcher: Launcher) -> list[str]:
    """The launcher's generated block, BEGIN and END lines included."""
    defaults = launcher_defaults(launcher.path.read_text().splitlines())
    extra = {before: [] for _, before, _, _ in LAUNCHER_ONLY}
    for variable, before, _, comment in LAUNCHER_ONLY:
        extra[before].append((variable, comment))
    out = [SH_BEGIN,
           f"# Every knob of config.py that applies to `python -m train {launcher.mode}`, as "
           f"VARIABLE=${{VARIABLE:-default}}",
           f"# (docs/knobs.md). Empty: the launcher's preset ({launcher.preset}), else config.py's default.",
           GIVEN_LINE]  # fmt: skip
    section = None
    for knob in all_knobs():
        if not applies(knob, launcher.mode):
            continue
        if knob.section != section:
            section = knob.section
            out += ([""] if len(out) > 3 else []) + [f"# ---- {SECTION_TITLES.get(section, section)} ----"]
        for variable, comment in extra.get(knob.name, []):
            out.append(knob_line(variable, defaults.get(variable, ""), comment))
        variable = knobs.env_name(knob.name)
        default = defaults.get(variable, "")
        comment = summary(knob, launcher.mode)
        if not default and (empty := empty_means(knob, launcher.preset, launcher.mode)):
            comment = f"{comment}; {empty}" if comment else empty
        out.append(knob_line(variable, default, comment))
    return [*out, SH_END]


def rewritten(lines: list[str], block: list[str]) -> list[str]:
    span = block_span(lines)
    if span is None:  # a launcher with no knob lines yet: the block goes under `set -euo pipefail`
        at = next((i + 1 for i, line in enumerate(lines) if line.startswith("set -")), len(lines))
        return [*lines[:at], "", *block, *lines[at:]]
    return [*lines[: span[0]], *block, *lines[span[1] :]]


# ---- docs/knobs.md ----------------------------------------------------------------------------

def _cell(text: str) -> str:
    text = text.replace("|", "\\|")
    return re.sub(r"<(?=[A-Za-z/])", "&lt;", text)  # runs/<name>/ is text, not an HTML tag


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def takes(name: str) -> str:
    """The values a field accepts, from its type and knob(...) range, choices and markers."""
    klass = config.SECTIONS[config.FIELD_SECTION[name]]
    f = next(f for f in dataclasses.fields(klass) if f.name == name)
    least, above, choices = f.metadata.get("least"), f.metadata.get("above"), f.metadata.get("choices")
    kind = str(f.type).split("|")[0].strip()
    if choices:
        said = ", ".join(f"`{c}`" for c in choices)
    elif kind == "bool":
        said = f"`--{name}`, `1` or `0`" if has_mark(f, "switch") else "`1` or `0`"
    elif kind in ("int", "float"):
        number = "a whole number" if kind == "int" else "a number"
        bound = (
            f" > {shown(above)}" if above is not None else f" >= {shown(least)}" if least is not None else ""
        )
        below = f.metadata.get("below")
        said = number + bound + (f" and < {shown(below)}" if below is not None else "")
    else:
        said = "text"
    return said + (", `auto`" if has_mark(f, "auto") else "")


def _table(rows: list[tuple[str, str, str, str]], mode: str | None = None) -> list[str]:
    """rows of (variable, flag, field (or, for a launcher-only variable, what it takes), what it
    does) -> a Markdown table, with a column for each preset that sets one of its knobs; the defaults
    are `mode`'s own where it has them (config.MODE_DEFAULTS)."""
    presets = [p for p in config.PRESETS if any(name in config.PRESETS[p] for _, _, name, _ in rows)]
    out = [_row(["launcher variable", "flag", "takes", "default", *presets, "what it does"]),
           _row(["---"] * (len(presets) + 5))]  # fmt: skip
    for variable, flag, name, doc in rows:
        field = name in config.FIELD_SECTION
        values = [f"`{shown(config.PRESETS[p][name])}`" if name in config.PRESETS[p] else "" for p in presets]
        default = shown(knobs.default(name, mode)) if field else ""
        accepted = takes(name) if field else name
        out.append(_row([variable, flag, accepted, f"`{default}`" if default else "", *values, _cell(doc)]))
    return out


def markdown() -> list[str]:
    """docs/knobs.md's generated part: one table per config section for the knobs every mode reads,
    then one per set of modes (knob(modes=...)) for the knobs only those read. BEGIN and END lines
    included."""
    all_modes = frozenset(config.MODES)
    kept: dict[frozenset, list[Knob]] = {}
    for knob in all_knobs():
        kept.setdefault(knob.modes, []).append(knob)
    every = kept.pop(all_modes, [])
    extra = {before: [] for _, before, _, _ in LAUNCHER_ONLY}
    for variable, before, accepted, comment in LAUNCHER_ONLY:
        extra[before].append((variable, accepted, comment))
    commands = " | ".join(config.MODES)
    out = [MD_BEGIN, "", "## Every mode", "",
           f"Read by every mode (`python -m train {commands}`): every launcher carries them.", ""]
    for section in config.SECTIONS:
        rows = []
        for knob in (k for k in every if k.section == section):
            for variable, accepted, comment in extra.get(knob.name, []):
                flag = dict(s.split(":") for s in knobs.PRECISION_SWITCHES).get(variable, "(launcher only)")
                rows.append((variable, flag, accepted, comment))
            rows.append((knobs.env_name(knob.name), f"--{knob.name}", knob.name, knob.doc))
        if rows:
            out += [f"### {SECTION_TITLES.get(section, section)}", "", *_table(rows), ""]
    by_launcher = launchers()
    for modes, group in kept.items():
        named = [m for m in config.MODES if m in modes]
        title = " and ".join(knobs.mode_name(m) for m in named)
        scripts = ", ".join(f"`{lw.path.name}`" for lw in by_launcher if lw.mode in modes) or "none yet"
        out += [f"## {title[0].upper()}{title[1:]}", "",
                f"Read by `python -m train {' | '.join(named)}` only (launchers: {scripts}); the other modes "
                "refuse them when set (one line naming the variable, exit 2), and their launchers leave them "
                "out.", ""]
        rows = [(knobs.env_name(k.name), f"--{k.name}", k.name, k.doc) for k in group]
        out += [*_table(rows, named[0] if len(named) == 1 else None), ""]
    return [*out, MD_END]
