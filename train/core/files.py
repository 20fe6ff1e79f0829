"""Durable writes: a file's (or folder's) data on disk before it is renamed into place, so a
power cut or a kill cannot leave a complete-looking name over missing blocks."""

from __future__ import annotations

import os
from pathlib import Path


def fsync(path: Path) -> None:
    """fsync one file or folder (a folder: its entries, as a rename needs)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
