"""Command line: `python -m train <command> [--flags]`; every config field is a --<field> flag."""

from __future__ import annotations

import importlib
import os
import sys
from functools import partial

from train.config.flags import parse_training_args
from train.core.errors import UsageError

TRAIN_COMMANDS = ("pretrain", "sft", "dpo", "grpo")
# Commands that take the training flags and run real steps: module and entry point, imported late.
TOOL_COMMANDS = {
    "find-batch": ("train.tools.find_batch", "find_batch_main"),
    "doctor": ("train.tools.doctor", "doctor_main"),
    "autotune": ("train.tools.autotune", "autotune_main"),
}


USAGE = """usage: python -m train <command> [--flags]

commands:
  pretrain   train a model from scratch on text: GPT-2 (causal LM) or T5 (encoder-decoder)
             (run_single_gpu*.sh)
  sft        fine-tune a trained model on chat or instruction data (train_sft_custom.sh,
             quick_start_sft_fast.sh)
  dpo        preference training (DPO, IPO, hinge, SimPO, ORPO) of a chat model on chosen / rejected
             pairs (train_dpo.sh)
  grpo       reward training (GRPO) of a chat model: sampled completions scored by reward functions
             (train_grpo.sh)
  generate   sample from a trained model with its chat template: generate --model DIR --prompt TEXT
  compare    compare run folders side by side: compare RUN_A RUN_B ...
  monitor    live GPU table (--once: one row)
  find-batch the fastest micro-batch that fits TARGET_VRAM, same effective batch (training flags)
  doctor     a short profiled run of your config and what to change (--apply: try it)
  autotune   timed trials of batch x accumulation, workers, precision, compile; writes the winner
  bench      time the real training loop (--vs-plain: against a plain PyTorch loop)
  knobs      the knob docs generated from config.py: --markdown, --launcher NAME, --write (make knobs)
  import     a bare state_dict checkpoint (ChatLM's *.bin + model_config.json) as a transformers
             folder: import SRC DEST [--tokenizer_path T]

`python -m train <command> --help` lists the flags. Run it from the kit's folder with the kit's Python,
.venv/bin/python -m train ... (or after `source .venv/bin/activate`): a bare python has no torch."""


def _ahead_of_the_run(cfg, say, world, fill: bool = False):
    """DRY_RUN=1: show the plan and stop (an exit code); AUTO_BATCH=1: find-batch chooses
    BATCH_SIZE x GRADIENT_ACCUM for the plan (a plan.Chosen), then the run goes on; fill (no
    BATCH_SIZE of the user's): a fill.Fill, the plan's word to fill a GPU by the estimate."""
    from train.run.plan.fill import Fill

    if cfg.run.dry_run:
        from train.tools.dryrun import dry_run

        return dry_run(cfg, say, Fill() if fill else None)  # the plan a real run makes: filled on a GPU
    if cfg.optim.auto_batch:
        from train.tools.find_batch import auto_batch

        return auto_batch(cfg, say, world)
    return Fill() if fill else None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command in TRAIN_COMMANDS:
        from train.distributed.world import from_env, quiet_errors  # no torch yet: a bad flag is said at once

        # RANK / LOCAL_RANK / WORLD_SIZE (torchrun, accelerate launch) are read here and only here.
        world = from_env(os.environ)
        with quiet_errors(world):
            cfg = parse_training_args(command, rest)
            if cfg.run.resume:
                from train.run.guard.carry import carry

                # RESUME=1: what this command does not set again is the run's own (train/run/guard/carry.py)
                cfg = carry(cfg, command, rest, print if world.is_main else lambda line: None)
        from train.distributed import process_group
        from train.run.pipeline import train
        from train.run.plan.fill import batch_set_by_user

        ahead = partial(_ahead_of_the_run, fill=not batch_set_by_user(command, rest, cfg, os.environ))
        return process_group.launch(partial(train, before=ahead), cfg, world)
    if command == "compare":
        from train.observe.compare import compare_main

        return compare_main(rest)
    if command == "generate":
        from train.tools.generate import generate_main

        return generate_main(rest)
    if command == "monitor":
        from train.observe.monitor import monitor_main

        return monitor_main(rest)
    if command == "bench":
        from train.tools.bench import bench_main

        return bench_main(rest)
    if command == "import":
        from train.tools.import_model import import_main

        return import_main(rest)
    if command == "knobs":
        from train.config.knob_command import knobs_main

        return knobs_main(rest)
    if command in TOOL_COMMANDS:
        module, function = TOOL_COMMANDS[command]
        return getattr(importlib.import_module(module), function)(rest)
    raise UsageError(
        f"unknown command {command!r}; expected one of: {', '.join(TRAIN_COMMANDS)}, generate, compare, "
        f"monitor, bench, import, knobs, {', '.join(TOOL_COMMANDS)}"
    )
