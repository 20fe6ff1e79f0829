"""The errors users see as one line: a bad setting or file (exit code 2), or Ctrl+C before
training started (exit code 130, like any program stopped by SIGINT)."""


class UsageError(Exception):
    """Bad input from the user (a variable, a flag, a file). `python -m train` prints the
    message as one line on stderr and exits with code 2, without a traceback."""


class Interrupted(BaseException):
    """Ctrl+C (or SIGTERM) while building something that is only saved once complete, such as
    the token cache. `python -m train` prints the message and exits with code 130.

    A BaseException, like KeyboardInterrupt, so that no `except Exception` on the way up
    mistakes it for a failure to recover from."""

    def __init__(self, message: str, exit_code: int = 130):
        super().__init__(message)
        self.exit_code = exit_code  # 128 + the signal's number, as the shell reports it


EXIT_USAGE = 2
