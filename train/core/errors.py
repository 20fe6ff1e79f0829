"""The one error type users see: a bad setting or file, reported as one line, exit code 2."""


class UsageError(Exception):
    """Bad input from the user (a variable, a flag, a file). `python -m train` prints the
    message as one line on stderr and exits with code 2, without a traceback."""


EXIT_USAGE = 2
