"""Writes into a user's folder (a run folder, CACHE_DIR) that never follow a link, and reads
that stay inside the folder they were given.

Whole files: `atomic_write` / `write_json` (or `writing`, to stream one) write a fresh temporary name in the
same folder, opened with O_CREAT|O_EXCL|O_NOFOLLOW (a link or file planted at that name makes the open fail
instead of being written through; another fresh name is tried), fsync it, rename it over the target (a rename
replaces a link at the target, it never writes where the link points) and fsync the folder, so a power cut or
a kill leaves the old file or the new one, never half of one and never a temporary file behind (it is removed
on any failure).

Appends (metrics.jsonl, train.log): `open_append` opens with O_APPEND|O_NOFOLLOW, so a link at
the name is refused (LinkRefused, one line naming the file), and `Appender.write` writes each
row with one os.write; a failed or short write (a full disk) is cut back to where the row began,
so the file holds whole rows only.

Folders (final/, a checkpoint, the tokenizer): `fresh_folder` makes a new folder under a fresh
name (mkdir fails on anything already there, a link included), `sync_tree` fsyncs what was
written into it, `replace_folder` renames it into place. `remove` deletes a file, link or
folder without ever following a link. `read_user_file` reads a user's small file (a settings
file, a template) whole, refusing a FIFO or device in one line before it can block or never end;
`odd_kind` tells what such a file is. `inside` checks a relative name read from a file
(a checkpoint's meta.json, a cache manifest) before it is opened.

Failures are OSError with the target's path as filename (the caller turns them into its one
line); LinkRefused is a UsageError (exit code 2).
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import secrets
import shutil
import stat
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from train.core.errors import UsageError

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)  # absent on Windows, where links need privileges
CLOEXEC = getattr(os, "O_CLOEXEC", 0)
OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how Rust libraries (safetensors, tokenizers) report one
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_TRIES = 16  # fresh names tried before giving up: each is 32 random bits, so only a planted one collides


class LinkRefused(UsageError):
    """A symbolic link where the kit writes or reads a file of its own folder: refused, never
    followed (it could point anywhere outside the folder)."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        super().__init__(
            f"{path} is a symbolic link; the kit never writes or reads through a link in its own folders "
            "(remove it and run again)"
        )


def sha256_of(path: Path) -> str:
    """A file's sha256, read in 4 MB blocks (a checkpoint's or a cache file's: never whole)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def fsync(path: Path) -> None:
    """fsync one file or folder (a folder: its entries, as a rename needs)."""
    fd = os.open(path, os.O_RDONLY | CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def json_safe(value):
    """JSON-safe: non-finite floats become null instead of invalid JSON (NaN, Infinity)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def _as_target(err: OSError, path: Path) -> OSError:
    """The same error, naming the file the caller asked for rather than a temporary name."""
    return OSError(err.errno, err.strerror or str(err), str(path))


def errno_of(err: BaseException | None) -> int | None:
    """The OS error behind err (an OSError, or a Rust library's "... (os error 28)" text, which
    safetensors and tokenizers raise as a plain Exception), or None when it is not one."""
    while err is not None:
        if isinstance(err, OSError) and err.errno:
            return err.errno
        found = OS_ERROR.search(str(err))
        if found:
            return int(found.group(1))
        err = err.__cause__ or err.__context__
    return None


def _fresh_file(path: Path) -> tuple[int, Path]:
    """A new, empty file beside path under a name no one has made: (descriptor, name)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | CLOEXEC
    for _ in range(_TRIES):
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue  # planted (or left by a killed writer): never opened, another name instead
    raise OSError(errno.EEXIST, "no fresh temporary name could be made beside it", str(path))


def _write_all(fd: int, data: bytes) -> None:
    """All of data: os.write may write less (a disk filling up); the next call then fails."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        if written == 0:  # no progress and no error: treat as the full disk it is
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view = view[written:]


@contextmanager
def writing(path: Path | str) -> Iterator[BinaryIO]:
    """Stream a file into place: yields a binary handle on a fresh temporary name beside path
    (O_EXCL|O_NOFOLLOW); on a clean exit it is fsynced, closed and renamed over path (a link at
    path is replaced, never written through) and the folder fsynced. On any exception (Ctrl+C
    included) the temporary file is removed and path is as it was; an OSError names path.

        with files.writing(cache / "tokens.bin") as out:
            for block in blocks:
                out.write(block)
    """
    path = Path(path)
    try:
        fd, tmp = _fresh_file(path)
    except OSError as err:
        raise _as_target(err, path) from None
    try:
        with open(fd, "wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        _unlink_quiet(tmp)
        if isinstance(err, OSError):
            raise _as_target(err, path) from None
        raise
    fsync(path.parent)


def atomic_write(path: Path | str, data: bytes | str) -> None:
    """Replace path with data, whole (see `writing`): a fresh temporary name, written, fsynced,
    renamed over path, the folder fsynced; on failure path is as it was and no temporary file
    stays; the OSError names path."""
    with writing(path) as out:
        out.write(data.encode() if isinstance(data, str) else data)


def write_json(path: Path | str, obj, indent: int | None = 2) -> None:
    """obj as JSON (non-finite floats as null) through atomic_write."""
    atomic_write(path, json.dumps(json_safe(obj), indent=indent) + "\n")


def read_text(path: Path | str) -> str:
    """A file of the kit's own folder, read without following a link (LinkRefused)."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | NOFOLLOW | CLOEXEC)
    except OSError as err:
        if err.errno == errno.ELOOP or path.is_symlink():
            raise LinkRefused(path) from None
        raise
    with open(fd, encoding="utf-8", errors="replace") as handle:
        return handle.read()


class Appender:
    """One append-only file (metrics.jsonl, train.log) held open; each write lands whole or
    not at all (see the module doc)."""

    def __init__(self, path: Path, fd: int):
        self.path, self.fd = path, fd
        self._lock = threading.Lock()  # library warnings reach train.log from other threads too

    def write(self, text: str) -> None:
        """Append text (a whole row with its newline). A failure (full disk, EFBIG) cuts the
        file back to where the row began and raises the OSError, naming the file."""
        data = text.encode()
        with self._lock:
            start = os.fstat(self.fd).st_size
            try:
                _write_all(self.fd, data)
            except OSError as err:
                try:
                    os.ftruncate(self.fd, start)  # shrinking needs no space
                except OSError:
                    pass
                raise _as_target(err, self.path) from None

    def close(self) -> None:
        with self._lock:
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None


def open_append(path: Path | str) -> Appender:
    """path opened for appending (created if missing), O_NOFOLLOW: a link there is refused
    with LinkRefused, naming the file."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | NOFOLLOW | CLOEXEC, 0o666)
    except OSError as err:
        if err.errno == errno.ELOOP or path.is_symlink():
            raise LinkRefused(path) from None
        raise
    return Appender(path, fd)


def fresh_folder(parent: Path, prefix: str) -> Path:
    """A new empty folder parent/<prefix><8 random hex digits>: mkdir never follows or reuses
    what is there, so nothing planted under such a name is written into."""
    for _ in range(_TRIES):
        folder = parent / f"{prefix}{secrets.token_hex(4)}"
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            continue
    raise OSError(errno.EEXIST, "no fresh temporary folder could be made", str(parent / prefix))


def sync_tree(folder: Path) -> None:
    """fsync every file written into folder (links are not followed), its subfolders, then folder."""
    for path in sorted(folder.rglob("*"), reverse=True):  # deepest first: files before their folder
        if not path.is_symlink():
            fsync(path)
    fsync(folder)


def replace_folder(tmp: Path, target: Path) -> None:
    """Rename the complete folder tmp to target. A folder already at target is set aside under a
    fresh name, and removed only once tmp is in place (restored if the rename fails); a link or
    file there is removed, never followed."""
    aside = None
    if target.is_symlink() or target.is_file():
        target.unlink()
    elif target.exists():
        aside = fresh_folder(target.parent, f".{target.name}.old-")
        os.replace(target, aside)  # an empty folder is replaced by a rename
    try:
        os.replace(tmp, target)
    except BaseException:
        if aside is not None and not target.exists():
            os.replace(aside, target)
        raise
    fsync(target.parent)
    if aside is not None:
        remove(aside)


def remove(path: Path) -> None:
    """Delete a file, a link (the link itself, never what it points to) or a folder (whose
    links are unlinked, not followed); nothing there is fine."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink()
    except FileNotFoundError:
        pass


def _unlink_quiet(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def inside(folder: Path, name: object) -> Path | None:
    """folder/name when name (read from a file of that folder) is a plain relative path that
    stays inside it and no part of which is a link; else None. Such a name is refused, never
    opened: "shards/../../etc/hostname" or a shard linked to a file outside would be read."""
    if not isinstance(name, str) or not name or "\\" in name or "\x00" in name:
        return None
    pure = PurePosixPath(name)
    if pure.is_absolute() or any(part in ("..", ".") for part in pure.parts) or name != str(pure):
        return None
    path = folder
    for part in pure.parts:
        path = path / part
        if path.is_symlink():
            return None
    return path


USER_FILE_BYTES = 64 << 20  # a settings file, a template, a tools list: kB in practice


def odd_kind(path: Path | str) -> str | None:
    """"a FIFO", "a socket", "a device" for what is neither a regular file nor a folder (stat follows
    a link, as open would); None otherwise, or where nothing is there."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    return _kind(mode)


def _kind(mode: int) -> str | None:
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    return "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"


def read_user_file(path: Path | str, what: str, limit: int = USER_FILE_BYTES) -> bytes:
    """A user's file named by `what` (GENERATION_CONFIG, TEMPLATE, --tools), read whole. Opened
    without blocking and checked on the open descriptor, so a FIFO (whose open or read waits for a
    writer forever), a device (/dev/zero never ends) or a file over `limit` bytes is one line
    (UsageError) naming `what`, never read. A missing or unreadable file is the OSError."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | CLOEXEC)
    except OSError as err:
        if err.errno == errno.ENXIO:  # a socket
            raise UsageError(f"{what}: {path} is a socket, not a regular file; name a file") from None
        raise
    try:
        info = os.fstat(fd)
        kind = "a folder" if stat.S_ISDIR(info.st_mode) else _kind(info.st_mode)
        if kind:
            raise UsageError(f"{what}: {path} is {kind}, not a regular file; name a file")
        if info.st_size > limit:
            raise UsageError(f"{what}: {path} is {info.st_size} bytes; such a file holds at most {limit}")
        os.set_blocking(fd, True)
        with open(fd, "rb", closefd=False) as handle:
            data = handle.read(limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:  # grew while read
        raise UsageError(f"{what}: {path} is over {limit} bytes; such a file holds at most {limit}")
    return data
