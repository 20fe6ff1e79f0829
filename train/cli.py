"""Command line: `python -m train <command> [--flags]`; every config field is a --<field> flag."""

from __future__ import annotations

import argparse
import sys

import config
from train.errors import UsageError

TRAIN_COMMANDS = ("pretrain", "sft")


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
            if value is not None or name in ("model_size", "max_length", "warmup_steps"):
                overrides[name] = value
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
  compare    compare run folders side by side: compare RUN_A RUN_B ...
  monitor    live GPU table (--once: one row)
  bench      time the real training loop (--vs-plain: against a plain PyTorch loop)

`python -m train <command> --help` lists the flags."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command in TRAIN_COMMANDS:
        cfg = parse_training_args(command, rest)
        from train.loop import train

        return train(cfg)
    if command == "compare":
        from train.compare import compare_main

        return compare_main(rest)
    if command == "monitor":
        from train.monitor import monitor_main

        return monitor_main(rest)
    if command == "bench":
        from train.bench import bench_main

        return bench_main(rest)
    raise UsageError(f"unknown command {command!r}; expected one of: {', '.join(TRAIN_COMMANDS)}, compare, monitor, bench")
