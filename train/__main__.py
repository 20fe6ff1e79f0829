"""`python -m train ...`: bad input becomes one line on stderr and exit code 2."""

import sys

from train.errors import EXIT_USAGE, UsageError


def run() -> int:
    try:
        from train.cli import main

        return main()
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    code = run()
    # After a process group: exit without the interpreter's teardown (train/distributed.py).
    distributed = sys.modules.get("train.distributed")
    if distributed is not None:
        distributed.exit_process(code)
    sys.exit(code)
