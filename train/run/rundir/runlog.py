"""Warnings into train.log: what the libraries print to the console during a run (Python
warnings, transformers' and torch's logged warnings) also goes to the run's log, one line
each, so `tail -f runs/<name>/train.log` shows everything the console did. Console: the
run's own lines, through tqdm so the progress bar stays intact."""

from __future__ import annotations

import contextlib
import logging
import warnings

from tqdm import tqdm

LOGGERS = ("transformers", "torch")


def first_line(text: str) -> str:
    return next((line.strip() for line in str(text).splitlines() if line.strip()), "")


class _LogHandler(logging.Handler):
    def __init__(self, write):
        super().__init__(logging.WARNING)
        self.write = write

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.write(f"warning: [{record.name.split('.')[0]}] {first_line(record.getMessage())}")
        except Exception:
            pass  # a log line must never stop training


@contextlib.contextmanager
def capture_warnings(console):
    """While the run lasts, copy warnings into console's log (the console already shows them:
    the libraries print them to stderr themselves)."""

    def write(line: str) -> None:
        if console.run_dir is None:
            console.pending.append(line)
        else:
            console.run_dir.log(line)

    shown = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        shown(message, category, filename, lineno, file, line)
        with contextlib.suppress(Exception):
            write(f"warning: {category.__name__}: {first_line(message)}")

    handler = _LogHandler(write)
    loggers = [logging.getLogger(name) for name in LOGGERS]
    warnings.showwarning = showwarning
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield
    finally:
        warnings.showwarning = shown
        for logger in loggers:
            logger.removeHandler(handler)


class Console:
    """Console lines (through tqdm so the bar stays intact), copied into train.log."""

    def __init__(self):
        self.pending, self.run_dir = [], None

    def __call__(self, line: str) -> None:
        tqdm.write(line)
        if self.run_dir is None:
            self.pending.append(line)
        else:
            self.run_dir.log(line)

    def attach(self, run_dir) -> None:
        self.run_dir = run_dir
        for line in self.pending:
            run_dir.log(line)
        self.pending = []


class Quiet:
    """The console of ranks other than 0: N copies of every line help no one."""

    def __call__(self, line: str) -> None:
        pass

    def attach(self, run_dir) -> None:
        pass
