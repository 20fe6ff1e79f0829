"""RESUME=1 continues a run with that run's own settings: every knob the resuming command does not
set again is taken from the run's config.json ("asked": what the run's command set, before the
plan's decisions), so `RESUME=1 RUN_NAME=<name> ./run_single_gpu.sh` keeps MAX_STEPS, MODEL_SIZE,
DATA_PATH ... as they were. Without it a resume of `MODEL_SIZE=nano MAX_STEPS=40` planned the CPU
demo's 256 samples and stopped at step 32, "completed". A knob given again wins: a changed length
or batch is then re-planned from the checkpoint (train/run/guard/resume_state.py).

Precedence on a resume: config.py's default < preset < the run's saved settings < the flag.
"""

from __future__ import annotations

from dataclasses import asdict

import config
from train.config.flags import training_parser
from train.core.errors import UsageError
from train.run.rundir.claim import plan_run_dir
from train.run.rundir.report import asked_settings

# Where and how this session runs, never the run's own settings.
NEVER = ("mode", "resume", "run_name", "output_dir", "overwrite", "dry_run", "launcher")


def given(command: str, argv: list[str]) -> set[str]:
    """The fields the command line sets (the launchers pass a flag only for a variable that is set)."""
    args = training_parser(command).parse_args(argv)
    named = {name for name in config.FIELD_SECTION if getattr(args, name, None) is not None}
    if args.fp16 or args.bf16:
        named.add("precision")
    return named


def carry(cfg: config.TrainConfig, command: str, argv: list[str], say=print) -> config.TrainConfig:
    """cfg with the resumed run's settings where this command sets none (module doc); says which."""
    if not cfg.run.resume:
        return cfg
    r = cfg.run
    try:
        run_path = plan_run_dir(r.output_dir, r.run_name, r.launcher, r.overwrite, resume=True)
    except UsageError:  # said by the run itself, in its order (a folder in use before "no checkpoint")
        return cfg
    saved = asked_settings(run_path)
    if not saved:
        return cfg
    now = {k: v for section in asdict(cfg).values() for k, v in section.items()}
    skip = given(command, argv) | set(NEVER)
    taken = {k: v for k, v in saved.items() if k not in skip and v != now[k]}
    if not taken:
        return cfg
    carried = config.TrainConfig.from_flat({**now, **taken})  # validated as any flag is
    shown = " ".join(f"{config.env_name(k)}={'' if v is None else int(v) if isinstance(v, bool) else v}"
                     for k, v in sorted(taken.items()))  # fmt: skip
    say(f"RESUME=1: settings not given again are {run_path.name}'s own: {shown}")
    return carried
