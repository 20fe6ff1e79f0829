"""`python -m train ...`: bad input becomes one line on stderr and exit code 2."""

import errno
import os
import select
import signal
import stat
import sys

from train.core.errors import EXIT_USAGE, Interrupted, UsageError

# Errors of the machine rather than of the code: a full disk, a folder without write access, a
# path through a file. The places that know which variable a path came from report it
# themselves; this is the net for the rest, one line instead of a traceback. Others (a missing
# file the code itself should have made, say) keep their traceback: that is a bug to report.
ENVIRONMENT_ERRNOS = {
    errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR,
    errno.EISDIR, errno.ENAMETOOLONG, errno.EMFILE, errno.ENFILE, errno.EIO, errno.EFBIG,
}  # fmt: skip


def describe_os_error(err: OSError) -> str:
    """One line for an OSError of the file system: <what> (<path>): <strerror>."""
    paths = " -> ".join(str(p) for p in (err.filename, err.filename2) if p is not None)
    where = f" ({paths})" if paths else ""
    return f"file-system error{where}: {err.strerror or err}"


def reader_gone() -> int:
    """stdout's reader has gone (`python -m train knobs --markdown | head`): stop quietly, as a tool
    that SIGPIPE ends does, with the code the shell gives such a tool (128 + SIGPIPE). stdout is pointed
    at /dev/null first, so the interpreter's last flush at exit finds no closed pipe to report."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):  # no stdout file descriptor to point elsewhere (an embedding host)
        pass
    return 128 + signal.SIGPIPE


def stdout_gone() -> bool:
    """Whether stdout itself is the pipe (or socket) whose reader has closed: another pipe's EPIPE (a
    worker's, a subprocess's) is a fault to report. A failed write leaves its bytes in stdout's buffer,
    so flushing meets the error again; with nothing buffered, poll() says POLLERR for a readerless pipe."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        return True
    except (OSError, ValueError, AttributeError):  # closed or no stdout: not a reader that went
        return False
    try:
        fd = sys.stdout.fileno()
        mode = os.fstat(fd).st_mode
        if not (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
            return False
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no descriptor, or no poll() (Windows)
        return False


def run() -> int:
    try:
        from train.cli import main

        code = main()
    except BrokenPipeError:  # before OSError: EPIPE on stdout is the reader's choice, not a fault
        if not stdout_gone():
            raise
        return reader_gone()
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except Interrupted as err:
        print(str(err), file=sys.stderr)
        return err.exit_code
    except ModuleNotFoundError as err:
        top = (err.name or "").split(".")[0]
        if not top or top in ("train", "config"):
            raise  # the kit's own module: a bug, with its traceback
        # a bare `python -m train` outside the kit's environment (no torch): one line, not 12 of traceback
        print(
            f"error: {top} is not installed in this Python ({sys.executable}); run the kit with its own: "
            ".venv/bin/python -m train ... (`make setup` makes .venv)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    except KeyboardInterrupt:
        # Ctrl+C before the training loop takes it over (loading, encoding SFT data ...).
        print("interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    except OSError as err:
        if err.errno not in ENVIRONMENT_ERRNOS:
            raise
        print(f"error: {describe_os_error(err)}", file=sys.stderr)
        return EXIT_USAGE
    try:
        sys.stdout.flush()  # the last buffered lines: a closed pipe is met here, not in the exit's flush
    except BrokenPipeError:
        gone = reader_gone()
        return code or gone  # main()'s own failure stays the code
    return code


if __name__ == "__main__":
    code = run()
    # After a process group: exit without the interpreter's teardown (train/distributed/process_group.py).
    distributed = sys.modules.get("train.distributed.process_group")
    if distributed is not None:
        distributed.exit_process(code)
    sys.exit(code)
