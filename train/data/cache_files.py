"""Writing into CACHE_DIR (the trained tokenizer, the token cache): whole files or none.

Everything is written under a fresh temporary name (never through a link planted there) and
renamed once complete and on disk (train/core/files.py), so a crash, a full disk or Ctrl+C
leaves either the old state or the new one, never half a file, and never a temporary file
behind. Failures become one line naming CACHE_DIR and the file.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from train.core import files
from train.core.errors import Interrupted, UsageError

# A file whose mtime or ctime is this recent is not remembered as checked: a change within the
# file system's timestamp granularity would not show (git's "racily clean" rule).
SETTLED_NS = 2_000_000_000


def settled(st: os.stat_result) -> bool:
    """Old enough that a later change must move its mtime or ctime (see SETTLED_NS)."""
    return max(st.st_mtime_ns, st.st_ctime_ns) < time.time_ns() - SETTLED_NS


def refuse_link(*paths: Path) -> None:
    """A folder of CACHE_DIR (tokens, tokenizers, sums, sft) that is a link is refused, as links
    in run folders are: everything under it would be written and read wherever it points."""
    for path in paths:
        if path.is_symlink():
            raise UsageError(f"CACHE_DIR: {path} is a symbolic link; the kit never writes or reads through a "
                             f"link in its own folders (remove it and run again)")  # fmt: skip


def cache_folder(path: Path) -> Path:
    """path, created with its parents, or a UsageError naming CACHE_DIR (a link there included)."""
    refuse_link(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UsageError(f"CACHE_DIR: {path} is a file, not a folder") from None
    except OSError as err:
        raise UsageError(f"CACHE_DIR: cannot create the folder {path}: {err.strerror or err}") from None
    return path


def remove(path: Path) -> None:
    """A file, link or folder of the cache, removed without following a link."""
    files.remove(path)


def drop_link(path: Path, say) -> None:
    """A link at one of the cache's names is not a cache this kit wrote (it could point
    anywhere): removed, never followed or read, with a note; the cache is then built again."""
    if path.is_symlink():
        say(f"{path} in CACHE_DIR is a symbolic link, not a cache this kit wrote; removed, building it again")
        remove(path)


@contextmanager
def locked(folder: Path, what: str, say) -> Iterator[None]:
    """An exclusive lock on folder (flock: dropped by the OS if the process dies)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"waiting for another process building {what} in {folder}")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class _Terminated(KeyboardInterrupt):
    """SIGTERM, handled like Ctrl+C while the cache is built."""


def _raise_terminated(signum, frame) -> None:
    raise _Terminated


@contextmanager
def building(activity: str, thing: str, final: Path) -> Iterator[list[Path]]:
    """Around the making of `final` (a file or folder of CACHE_DIR). Yields a list for the
    temporary paths the caller creates; on any failure they are removed. Ctrl+C (or SIGTERM,
    a scheduler stopping the job) becomes Interrupted("interrupted while <activity>..."), a
    file-system error (an OSError, or a Rust library's "os error N", as tokenizers raises a
    full disk) a UsageError naming CACHE_DIR, <thing> and final."""
    temps: list[Path] = []
    previous = None
    # SIGTERM is taken over only where nothing else handles it: the training loop installs its
    # own handlers later (train/run/guard/signals.py) and restores what was there before, which is this
    # default again by then.
    if (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    ):
        previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield temps
    except BaseException as err:
        for path in temps:
            remove(path)
        if isinstance(err, KeyboardInterrupt):
            signum = signal.SIGTERM if isinstance(err, _Terminated) else signal.SIGINT
            raise Interrupted(f"interrupted while {activity}; nothing was saved", 128 + signum) from None
        code = None if isinstance(err, UsageError) else files.errno_of(err)
        if code is not None:
            raise UsageError(f"CACHE_DIR: cannot write {thing} {final}: {os.strerror(code)}") from None
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def sync(path: Path) -> None:
    """Data of a written file (or of every file in a folder) on disk before it is renamed into
    place: otherwise a power cut can leave the new name pointing at missing blocks."""
    if path.is_dir():
        files.sync_tree(path)
    else:
        files.fsync(path)


def write_json(path: Path, value: dict, temps: list[Path] | None = None) -> None:
    """path replaced atomically: readers see the old JSON or the new, never a cut one. The
    temporary file is the helper's own, removed by it on any failure (train/core/files.py), so
    nothing is added to `building`'s temps."""
    files.write_json(path, value, indent=None)


def save_folder(folder: Path, save, temps: list[Path]) -> bool:
    """folder (the trained tokenizer) written whole: save(tmp) fills a fresh temporary folder
    beside it, which is fsynced and renamed into place. False, with folder left as it is, when
    another run (same corpus, same key) put a complete one there first. Inside `building`, whose
    temps list is passed here: a failure (a full disk) removes the temporary folder and becomes
    building's one line."""
    tmp = files.fresh_folder(folder.parent, f".{folder.name}.tmp-")
    temps.append(tmp)
    save(tmp)
    files.sync_tree(tmp)
    try:
        os.replace(tmp, folder)
    except OSError:
        if not (folder / "tokenizer.json").exists():
            raise
        remove(tmp)
        return False
    files.fsync(folder.parent)
    return True


def temp_folder(folder: Path, temps: list[Path]) -> Path:
    """A fresh folder beside `folder` to write a cache into (named for this host and process: runs
    on other machines sharing CACHE_DIR never collide), listed in `building`'s temps."""
    tmp = files.fresh_folder(folder.parent, f".{folder.name}.tmp-{socket.gethostname()}-{os.getpid()}-")
    temps.append(tmp)
    return tmp


def publish(tmp: Path, folder: Path, meta: dict, temps: list[Path], finished) -> None:
    """tmp, a cache written whole, becomes `folder`: meta.json last (a folder without it is an
    unfinished one), fsynced, renamed. When another run finished the same cache first
    (finished(folder) is true), tmp is removed and theirs is used."""
    write_json(tmp / "meta.json", meta, temps)
    files.sync_tree(tmp)
    try:
        os.rename(tmp, folder)
        files.fsync(folder.parent)
    except OSError:
        if not finished(folder):
            raise
        remove(tmp)


SEAL = "kit-sha256.json"  # a trained tokenizer's files and their sha256, written with them


def seal(folder: Path) -> None:
    """Record the sha256 of each file of a folder about to be renamed into the cache (the trained
    tokenizer), so a file edited later (two ids swapped in tokenizer.json) is noticed (unsealed)."""
    sums = {p.name: files.sha256_of(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name != SEAL}
    files.write_json(folder / SEAL, sums, indent=None)


def unsealed(folder: Path) -> str | None:
    """What is wrong with a sealed folder (a file added, missing, or whose bytes changed), or
    None. A tokenizer is a few MB: hashed on every load (~5 ms), nothing remembered."""
    try:
        sums = json.loads(files.read_text(folder / SEAL))
        names = sorted(p.name for p in folder.iterdir() if p.name != SEAL)
    except (OSError, ValueError, UsageError):
        return f"{SEAL} is missing or unreadable (a cache of an older kit, or edited)"
    if not isinstance(sums, dict) or sorted(sums) != names:
        return f"its files are not the ones {SEAL} lists"
    changed = [
        name for name in names if (folder / name).is_symlink() or files.sha256_of(folder / name) != sums[name]
    ]
    return f"{changed[0]} does not hold the bytes {SEAL} describes" if changed else None


def remove_abandoned(parent: Path) -> None:
    """Temporary folders of builds whose process is gone (SIGKILL, a power cut): never renamed,
    never to be; a live build's folder is left alone."""
    host = socket.gethostname()
    for tmp in parent.glob(".*.tmp-*"):
        # Only this machine's: a CACHE_DIR shared between machines holds builds of live processes
        # whose pids mean nothing here.
        owner, _, pid = tmp.name.rpartition(".tmp-")[2].rsplit("-", 1)[0].rpartition("-")
        if owner == host and pid.isdigit() and not _alive(int(pid)):
            remove(tmp)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


CHECKED = "checked.json"  # what a cache folder remembers of the files it has verified


class Hashed:
    """A binary file being written, with the sha256 of what went into it."""

    def __init__(self, handle):
        self.handle, self.digest = handle, hashlib.sha256()

    def write(self, data: bytes) -> None:
        self.digest.update(data)
        self.handle.write(data)

    def __getattr__(self, name):
        return getattr(self.handle, name)


def verify_sums(folder: Path, sums, names, check=None) -> str | None:
    """What is wrong with folder's files (names: the kit's own, never read from a file) against
    their sha256 in its manifest (and check(name), for each file read), or None. A file checked
    once, and settled, is remembered in checked.json by size, mtime, ctime, inode and sum, and
    not read again until one of them moves: a warm start hashes the cache once (about 0.5 GB/s
    on a 2-core EPYC), later ones only stat its files."""
    try:
        memo = json.loads(files.read_text(folder / CHECKED))
    except (OSError, ValueError, UsageError):
        memo = {}
    memo = memo if isinstance(memo, dict) else {}
    known = {}
    for name in names:
        want = sums.get(name) if isinstance(sums, dict) else None
        if not isinstance(want, str) or len(want) != 64:
            return f"meta.json has no checksum for {name}"
        st = os.lstat(folder / name)
        stamp = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, want]
        if memo.get(name) != stamp:
            if files.sha256_of(folder / name) != want:
                return f"{name} does not hold the bytes meta.json's checksum describes"
            if check is not None and (damage := check(name)):
                return damage
            if not settled(st):
                continue
        known[name] = stamp
    if known != memo:
        with contextlib.suppress(OSError):  # only a shortcut: unwritable, the next start hashes again
            write_json(folder / CHECKED, known)
    return None


def read_manifest(folder: Path, what: str, parse, names) -> tuple[tuple | None, str | None]:
    """A cache folder's meta.json as parse(raw) makes it (raising ValueError, KeyError or TypeError where
    it is not sound) and the size of each file names(meta) lists: ((meta, sizes), None); (None, what is
    wrong) for a damaged folder (meta.json unreadable, a file missing), which the caller rebuilds; an
    unreadable folder stops the run in one line naming `what` (the SFT cache, ...)."""
    try:
        meta = parse(json.loads(files.read_text(folder / "meta.json")))
        return (meta, {name: (folder / name).stat().st_size for name in names(meta)}), None
    except FileNotFoundError as err:
        return None, f"{Path(err.filename).name} is missing"
    except (ValueError, KeyError, TypeError, RecursionError, UsageError) as err:
        return None, f"meta.json cannot be read: {short(err)}"
    except OSError as err:
        raise UsageError(f"CACHE_DIR: cannot read {what} {folder}: {err.strerror or err}") from None


def short(err: BaseException) -> str:
    """An exception as a few words for a one-line note."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return text if len(text) <= 100 else text[:97] + "..."


def file_digest(path: Path, sums: Path | None, variable: str = "DATA_PATH") -> tuple[str, int]:
    """(sha256 of the file's bytes, its newline count). sums: a folder where it is remembered
    under the file's path, size, mtime, ctime, inode and device (what an in-place edit moves,
    `touch -r` included, as git's index keys it), so a warm start finds its cache without reading
    gigabytes of data again (the cache keys of pretraining and SFT are made of these). A memo
    names the file it describes and is used only for that file: one copied from another corpus's
    is not taken."""
    try:
        st = path.stat()
        memo = None
        if sums is not None:
            ident = [str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]
            key = hashlib.sha256("\0".join(map(str, ident)).encode())
            memo = sums / f"{key.hexdigest()[:32]}.json"
            # a link planted there is never read (files.read_text refuses it): the file is read again
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError, UsageError):
                known = json.loads(files.read_text(memo))
                if known["file"] == ident and isinstance(known["sha256"], str) and len(known["sha256"]) == 64:
                    return known["sha256"], int(known["lines"])
        digest, lines = hashlib.sha256(), 0
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
                lines += block.count(b"\n")
    except OSError as err:
        raise UsageError(f"{variable}: cannot read {path}: {err.strerror or err}") from None
    if memo is not None and settled(st):
        # only a shortcut: where it cannot be written, the next start reads the file again
        with contextlib.suppress(OSError):
            memo.parent.mkdir(parents=True, exist_ok=True)
            # no temp left
            files.write_json(memo, {"file": ident, "sha256": digest.hexdigest(), "lines": lines})
    return digest.hexdigest(), lines
