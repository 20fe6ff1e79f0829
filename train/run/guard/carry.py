"""RESUME=1 continues a run with that run's own settings: every knob the resuming command does not
set again is taken from the run's config.json ("asked": what the run's command set, before the
plan's decisions), so `RESUME=1 RUN_NAME=<name> ./run_single_gpu.sh` keeps MAX_STEPS, MODEL_SIZE,
DATA_PATH ... as they were. Without it a resume of `MODEL_SIZE=nano MAX_STEPS=40` planned the CPU
demo's 256 samples and stopped at step 32, "completed". A knob given again wins: a changed length
or batch is then re-planned from the checkpoint (train/run/guard/resume_state.py).

Precedence on a resume: config.py's default < preset < the run's saved settings < the flag.

The saved settings are trusted only as the kit wrote them: config.json's "asked" carries its sha256
("asked_sha256"), and every checkpoint holds a copy of the settings its session started with. An
edited config.json (a CACHE_DIR, DATA_PATH or MODEL_PATH changed by hand would write outside the run's
folders or train other data or another model, exit 0) is refused in one line, exit 2, naming the
settings that differ from the checkpoint's; a config.json gone is replaced by the checkpoint's copy.
A setting given again on the command line is the user's and wins, as above.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import config
from train.config.flags import training_parser
from train.core import files
from train.core.errors import UsageError
from train.run.checkpoint.on_disk import list_checkpoints
from train.run.plan.reward_funcs import user_files
from train.run.rundir.claim import plan_run_dir
from train.run.rundir.report import asked_seal, flat_asked

# Where and how this session runs, never the run's own settings.
NEVER = ("mode", "resume", "run_name", "output_dir", "overwrite", "dry_run", "launcher")


def given(command: str, argv: list[str]) -> set[str]:
    """The fields the command line sets (the launchers pass a flag only for a variable that is set)."""
    args = training_parser(command).parse_args(argv)
    named = {name for name in config.FIELD_SECTION if getattr(args, name, None) is not None}
    if args.fp16 or args.bf16:
        named.add("precision")
    return named


def _read_json(path: Path):
    try:
        return json.loads(files.read_text(path))
    except (OSError, ValueError, files.LinkRefused):
        return None


def sealed(run_path: Path) -> tuple[dict | None, str | None]:
    """(the newest checkpoint's copy of the settings its session started with, that checkpoint's name),
    or (None, None): no checkpoint, or only checkpoints of a kit from before the copy."""
    for folder in list_checkpoints(run_path / "checkpoints"):
        meta = _read_json(folder / "meta.json")
        asked = flat_asked(meta.get("asked")) if isinstance(meta, dict) else None
        if asked is not None:
            return asked, folder.name
    return None, None


def run_settings(run_path: Path, say) -> dict | None:
    """The settings the run was started with (module doc): config.json's "asked" where it is as the kit
    wrote it, else the newest checkpoint's copy where config.json is gone; UsageError where it was edited."""
    record = _read_json(run_path / "config.json")
    asked = record.get("asked") if isinstance(record, dict) else None
    flat = flat_asked(asked)
    copy, checkpoint = sealed(run_path)
    if flat is None:
        if copy is not None:
            say(f"RESUME=1: {run_path.name}/config.json is missing or unreadable: its settings are "
                f"checkpoint {checkpoint}'s copy")  # fmt: skip
        return copy
    seal = record.get("asked_sha256")
    # the kit's own (an older one: no seal)
    if seal == asked_seal(asked) or (seal is None and copy in (None, flat)):
        return flat
    differ = sorted(k for k in set(flat) | set(copy or {}) if copy is not None and flat.get(k) != copy.get(k))
    which = (
        f" ({', '.join(config.env_name(k) for k in differ)} differ from checkpoint {checkpoint}'s)"
        if differ
        else ""
    )
    raise UsageError(
        f"RESUME=1: {run_path / 'config.json'} was edited after the run wrote it{which}; a run resumes with "
        f"the "
        "settings it started with: put config.json back, remove it (the checkpoint's copy of the settings is "
        "then used), or start a new run"
    )


def carry(cfg: config.TrainConfig, command: str, argv: list[str], say=print) -> config.TrainConfig:
    """cfg with the resumed run's settings where this command sets none (module doc); says which."""
    if not cfg.run.resume:
        return cfg
    r = cfg.run
    try:
        run_path = plan_run_dir(r.output_dir, r.run_name, r.launcher, r.overwrite, resume=True)
    except UsageError:  # said by the run itself, in its order (a folder in use before "no checkpoint")
        return cfg
    saved = run_settings(run_path, say)
    if not saved:
        return cfg
    now = {k: v for section in asdict(cfg).values() for k, v in section.items()}
    skip = given(command, argv) | set(NEVER)
    taken = {k: v for k, v in saved.items() if k not in skip and v != now[k]}
    # code runs by the command line's word only
    if "reward_funcs" in taken and user_files(taken["reward_funcs"]):
        raise UsageError(f"RESUME=1: {run_path.name} scored with REWARD_FUNCS={taken['reward_funcs']}, which "
                         f"runs a file's code; name it again on this command (REWARD_FUNCS=...) to run it")
    if not taken:
        return cfg
    carried = config.TrainConfig.from_flat({**now, **taken})  # validated as any flag is
    shown = " ".join(f"{config.env_name(k)}={'' if v is None else int(v) if isinstance(v, bool) else v}"
                     for k, v in sorted(taken.items()))  # fmt: skip
    say(f"RESUME=1: settings not given again are {run_path.name}'s own: {shown}")
    return carried
