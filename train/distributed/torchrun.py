"""`python -m train.distributed.torchrun <torchrun arguments>`: torchrun (torch.distributed.run) as the
launchers
start it with NPROC_PER_NODE > 1, except that bad input stays what it is with one process: one
line from rank 0 and exit code 2, not torchrun's report of a failed child with a traceback.

A stop signal (Ctrl+C, a scheduler's SIGTERM) reaches torchrun, which passes it to every rank;
the ranks finish the step, save and exit, and this exits with 128 + the signal number, as one
process does, without torchrun's traceback. Any other failure (a crash, an out-of-memory error,
a lost node) is reported by torchrun as usual.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from train.core.errors import EXIT_USAGE


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # After passing a stop signal on, torchrun SIGKILLs ranks still running after this many
    # seconds (30 by default): short for a GPT-2 medium to finish its step, save a checkpoint
    # and write final/; longer would keep ranks stuck behind a dead one waiting as long.
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "120")
    args = parse_args(sys.argv[1:] if argv is None else argv)
    quiet = _DropUsageExits()
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if name.startswith("torch.distributed.elastic") and isinstance(logger, logging.Logger):
            logger.addFilter(quiet)  # a filter acts on the logger a record starts from, not its parents
    try:
        run(args)
    except SignalException as err:
        return 128 + int(err.sigval)  # the ranks got it too and stopped cleanly (train/run/guard/signals.py)
    except ChildFailedError as err:
        _, failure = err.get_first_failure()
        if failure.exitcode == EXIT_USAGE:
            return EXIT_USAGE  # every rank stopped on the same bad input; rank 0 printed it
        print(f"error: {_what_failed(err.failures)}", file=sys.stderr)
        return 1
    return 0


def _what_failed(failures: dict) -> str:
    """One line for torchrun's report of failed ranks: which died and how, and what to do.
    A rank killed by a signal (the out-of-memory killer, a lost node) is named rather than the
    ranks that then failed talking to it; a rank's own Python error is printed above by it."""
    killed = {r: f for r, f in failures.items() if f.exitcode < 0 and f.exitcode != -signal.SIGTERM}
    rank, failure = min((killed or failures).items(), key=lambda item: item[1].timestamp)
    how = f"was killed by {failure.signal_name()}" if failure.exitcode < 0 else (f"exited with code "
                                                                                 f"{failure.exitcode}")
    return (
        f"rank {rank} {how}; torchrun stopped the other ranks. Checkpoints already written are intact: "
        "RESUME=1 with the same RUN_NAME continues from the newest one"
    )


class _DropUsageExits(logging.Filter):
    """The agent logs each worker's exit; for exit code 2 rank 0's own line says it all ..."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        # ... for a stop signal the ranks' own lines say it ("SIGTERM: finishing this step"), and
        # for a failed rank main() prints one line of its own (_what_failed)
        return not any(k in text for k in ("failed (exitcode:", "closing signal", "death signal"))


if __name__ == "__main__":
    from train.distributed.process_group import exit_process

    # torchrun's agent leaves its rendezvous store's C++ threads running: ending the interpreter
    # under them can abort with SIGABRT ("terminate called without an active exception") after a
    # clean stop (seen once in the SIGTERM-to-torchrun test). Flush and exit without the teardown.
    exit_process(main(), group_used=True)
