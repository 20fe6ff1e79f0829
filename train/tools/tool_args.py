"""What the tool commands (find-batch, autotune, doctor) share on their command line: -h/--help with
their own flags beside the training ones, the optional first word naming the mode, and the unit their
rates count."""

from __future__ import annotations

from train.core.errors import UsageError
from train.core.objective import MODES as TRAINING_MODES
from train.core.objective import mode_of as mode_row


def wants_help(command: str, usage: str, argv: list[str], options: tuple = ()) -> bool:
    """-h/--help for a tool command: its own usage, then its own flags (options: (flag, help)
    pairs) listed apart, then the training flags it takes."""
    if not {"-h", "--help"} & set(argv):
        return False
    from train.config.flags import training_parser

    parser = training_parser(command)
    parser.description = f"{usage[0].upper()}{usage[1:]}. {parser.description}"
    # its own first
    parser.usage = "%(prog)s " + "".join(f"[{flag}] " for flag, _ in options) + "[training flags]"
    if options:
        own = parser.add_argument_group(f"{command}'s own flags")
        for flag, text in options:
            name, _, metavar = flag.partition(" ")
            kind = {"metavar": metavar} if metavar else {"action": "store_true"}
            own.add_argument(name, help=text.replace("%", "%%"), **kind)
    parser.print_help()
    return True


MODES = ("pretrain", "sft", "dpo")  # the training commands a tool's first word may name (train/cli.py's)


def mode_of(argv: list[str], tool: str, modes: tuple[str, ...] = MODES) -> tuple[str, list[str]]:
    """(the mode, the rest): a tool's optional first word (`find-batch dpo --model_path ...`), one of
    `modes`, else pretrain. A training mode the tool is not built for is one line (a UsageError), not
    argparse's "unrecognized arguments"."""
    if argv and argv[0] in modes:
        return argv[0], argv[1:]
    if argv and argv[0] in TRAINING_MODES:
        raise UsageError(f"{tool} {argv[0]}: {tool} is not built for {argv[0]}; it takes {', '.join(modes)}")
    return "pretrain", argv


def unit_of(mode: str) -> str:
    """What a micro-batch of `mode` counts (the tools' rates): its objective's unit (samples, pairs)."""
    return mode_row(mode).unit
