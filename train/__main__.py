"""`python -m train ...`: bad input becomes one line on stderr and exit code 2."""

import sys

from train.core.errors import EXIT_USAGE, UsageError


def run() -> int:
    try:
        from train.cli import main

        return main()
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(run())
