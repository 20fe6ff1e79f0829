"""Command line: `python -m train <command> [--flags]`; every config field is a --<field> flag."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

import config
from train.core.errors import UsageError

TRAIN_COMMANDS = ("pretrain", "sft")
# Commands that take the training flags and run real steps: module and entry point, imported late.
TOOL_COMMANDS = {
    "find-batch": ("train.tools.find_batch", "find_batch_main"),
    "doctor": ("train.tools.doctor", "doctor_main"),
    "autotune": ("train.tools.autotune", "autotune_main"),
}


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one UsageError line instead of usage + exit."""

    def error(self, message):
        raise UsageError(f"{self.prog}: {message} (see --help)")


def training_parser(command: str) -> argparse.ArgumentParser:
    docs = config.field_docs()
    parser = _Parser(prog=f"python -m train {command}", description=f"Train ({command}).")
    parser.add_argument("--preset", choices=sorted(config.PRESETS), help="named preset applied under the flags")
    parser.add_argument("--fp16", action="store_true", help="shorthand for --precision fp16 (ENABLE_FP16)")
    parser.add_argument("--bf16", action="store_true", help="shorthand for --precision bf16 (ENABLE_BF16)")
    parser.add_argument("--is_keep_training", nargs="?", const="1", help="the guides' name for --resume (RESUME)")
    for name in config.FIELD_SECTION:
        if name == "mode":
            continue
        kind = config.field_type(name)
        help_text = f"[{config.env_name(name)}] {docs.get(name, '')}".replace("%", "%%")
        if kind is bool:
            # `--pin_memory` alone means on; `--pin_memory 0` turns a preset's setting off.
            parser.add_argument(f"--{name}", nargs="?", const="1", default=None, help=help_text)
        else:
            parser.add_argument(f"--{name}", default=None, help=help_text)
    return parser


def parse_training_args(command: str, argv: list[str]) -> config.TrainConfig:
    """Flags -> validated TrainConfig (precedence: default < preset < flag)."""
    args = training_parser(command).parse_args(argv)
    overrides = {"mode": command}
    for name in config.FIELD_SECTION:
        text = getattr(args, name, None)
        if text is not None:
            value = config.parse_value(name, text)
            if value is not None or name in ("model_size", "max_length", "warmup_steps", "log_every"):
                overrides[name] = value
    if args.is_keep_training is not None:  # the guides' --is_keep_training=True: --resume under another name
        keep = config.parse_value("resume", args.is_keep_training)
        if args.resume is not None and config.parse_value("resume", args.resume) != keep:
            raise UsageError("--is_keep_training and RESUME (--resume) disagree: set one")
        overrides["resume"] = keep
    if args.fp16 and args.bf16:
        raise UsageError("ENABLE_FP16 and ENABLE_BF16 are both set: choose one precision")
    if (args.fp16 or args.bf16) and args.precision not in (None, ""):
        raise UsageError("PRECISION is set together with ENABLE_FP16/ENABLE_BF16: choose one")
    if args.fp16:
        overrides["precision"] = "fp16"
    if args.bf16:
        overrides["precision"] = "bf16"
    return config.resolve(args.preset, overrides)


USAGE = """usage: python -m train <command> [--flags]

commands:
  pretrain   train a causal LM from scratch on text (run_single_gpu*.sh)
  sft        supervised fine-tuning on chat/instruction data
  generate   sample from a trained model with its chat template: generate --model DIR --prompt TEXT
  compare    compare run folders side by side: compare RUN_A RUN_B ...
  monitor    live GPU table (--once: one row)
  find-batch the fastest micro-batch that fits TARGET_VRAM, same effective batch (training flags)
  doctor     a short profiled run of your config and what to change (--apply: try it)
  autotune   timed trials of batch x accumulation, workers, precision, compile; writes the winner
  bench      time the real training loop (--vs-plain: against a plain PyTorch loop)

`python -m train <command> --help` lists the flags."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command in TRAIN_COMMANDS:
        from train.dist import distributed

        # RANK / LOCAL_RANK / WORLD_SIZE (torchrun, accelerate launch) are read here and only here.
        world = distributed.from_env(os.environ)
        with distributed.quiet_errors(world):
            cfg = parse_training_args(command, rest)
        from train.run.loop import train

        return distributed.launch(train, cfg, world)
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
    if command in TOOL_COMMANDS:
        module, function = TOOL_COMMANDS[command]
        return getattr(importlib.import_module(module), function)(rest)
    raise UsageError(
        f"unknown command {command!r}; expected one of: {', '.join(TRAIN_COMMANDS)}, generate, compare, monitor, bench, {', '.join(TOOL_COMMANDS)}"
    )
