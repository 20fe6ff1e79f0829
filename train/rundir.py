"""The run folder contract: runs/<name>/ with config.json, metrics.jsonl, summary.json,
train.log and final/; runs/latest points at the newest run.

One run per folder at a time: a run claims its folder before anything is built (a new one made
atomically by mkdir) and holds an flock on it until it ends or its process dies. final/ and
best/ are written whole or not at all and carry a marker with their step, so a run counts as
finished only when summary.json and a complete final/ of the same step agree."""

from __future__ import annotations

import errno
import json
import math
import os
import re
import shutil
import time
from pathlib import Path

from train.errors import UsageError

try:
    import fcntl
except ImportError:  # Windows: no flock, so no run lock there
    fcntl = None

DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
COMPLETE = ".complete"  # written last into final/ and best/: {"step": N}
OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how safetensors (Rust) reports a failed write


def _clean(value):
    """JSON-safe: non-finite floats become null instead of invalid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def write_json(path: Path, data) -> None:
    """Write via a temporary file and rename, so a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(_clean(data), indent=2) + "\n")
    os.replace(tmp, path)


def plan_run_dir(output_dir: str, run_name: str | None, launcher: str, overwrite: bool, resume: bool = False) -> Path:
    """Pick the run folder without creating it (dry runs, doctor): a new unique name by default;
    an explicit RUN_NAME that exists is refused unless OVERWRITE=1; RESUME=1 picks the run to
    continue. A real run takes its folder with claim_run_dir."""
    root = Path(output_dir)
    if resume:
        from train.resume import find_run_dir

        return find_run_dir(root, run_name, launcher)
    if run_name is None:
        base = name = _default_name(launcher)
        n = 1
        while (root / name).exists():
            n += 1
            name = f"{base}-{n}"
        return root / name
    path = root / run_name
    if path.exists() and not overwrite:
        raise _exists(run_name, path)
    return path


def _default_name(launcher: str) -> str:
    return f"{launcher}-{time.strftime('%Y%m%d-%H%M%S')}"


def _exists(run_name: str, path: Path) -> UsageError:
    return UsageError(
        f"RUN_NAME={run_name}: {path} already exists; set OVERWRITE=1 to replace it, RESUME=1 to continue it, "
        "or pick another name"
    )


# ---- claiming the run folder ------------------------------------------------------------------


class RunClaim:
    """A run folder held for the run's life by an flock on the folder itself: no lock file to
    leave behind or to race over, and OVERWRITE empties the folder but keeps it, so the lock
    holds throughout. `created`: the folders the claim made, deepest first; release() removes
    those still empty, so a run that stopped on bad input leaves nothing behind."""

    def __init__(self, path: Path, fd: int | None, created: list[Path]):
        self.path, self.fd, self.created = path, fd, created

    def release(self) -> None:
        for folder in self.created:
            try:
                folder.rmdir()  # empty folders only: a run that wrote anything keeps its folder
            except OSError:
                break
        self.created = []
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None


def claim_run_dir(output_dir: str, run_name: str | None, launcher: str, overwrite: bool, resume: bool = False) -> RunClaim:
    """plan_run_dir's rules without its race: a new folder is made by mkdir, which fails when
    another run made it first (then the next free name, or the refusal of an existing RUN_NAME),
    and every folder is locked; one that a live run holds is refused, naming its pid."""
    root = Path(output_dir)
    label = f"RUN_NAME={run_name}" if run_name else "RESUME=1"
    if resume:
        path = plan_run_dir(output_dir, run_name, launcher, overwrite, resume)
        claim = _lock(path, [], label)
        if claim is None:
            raise UsageError(f"RESUME=1: {path} was removed while this run started")
        return claim
    created = _make_root(root)
    try:
        for _ in range(100):  # again only when the folder vanished between mkdir and the lock
            claim = _claim_once(root, run_name, launcher, overwrite, label)
            if claim is not None:
                claim.created += created
                return claim
        raise UsageError(f"OUTPUT_DIR (--output_dir): could not claim a run folder in {root}; try again")
    except BaseException:
        RunClaim(root, None, created).release()
        raise


def _claim_once(root: Path, run_name: str | None, launcher: str, overwrite: bool, label: str) -> RunClaim | None:
    if run_name is None:
        base = _default_name(launcher)
        path, n = root / base, 1
        while not _mkdir(path):  # two runs started in the same second: the second takes -2
            n += 1
            path = root / f"{base}-{n}"
        made = True
    else:
        path = root / run_name
        made = _mkdir(path)
        if not made and not overwrite:
            busy = _lock(path, [], label)  # a live run's folder: say that, not "exists"
            if busy is not None:
                busy.release()
            raise _exists(run_name, path)
    # A folder this claim made is not removed if another run locks it first: it is theirs now.
    return _lock(path, [path] if made else [], label)


def _make_root(root: Path) -> list[Path]:
    """Create OUTPUT_DIR if needed; returns the folders made, deepest first."""
    missing, folder = [], root
    while not folder.exists() and folder.parent != folder:
        missing.append(folder)
        folder = folder.parent
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise _cannot(root, err) from None
    return missing


def _mkdir(path: Path) -> bool:
    """True if this call made the folder, False if it was there already."""
    try:
        path.mkdir()
        return True
    except FileExistsError:
        return False
    except OSError as err:
        raise _cannot(path, err) from None


def _cannot(path: Path, err: OSError) -> UsageError:
    reason = "a file is in the way" if isinstance(err, FileExistsError) else err.strerror or str(err)
    return UsageError(f"OUTPUT_DIR (--output_dir): cannot create {path} ({reason}); pick a folder you can write to")


def _lock(path: Path, created: list[Path], label: str) -> RunClaim | None:
    """Lock the folder; None if it vanished or was replaced before the lock was taken."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise UsageError(f"{label}: cannot open {path} ({err.strerror}); pick another RUN_NAME") from None
    if fcntl is None:
        return RunClaim(path, fd, created)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise UsageError(
            f"{label}: {path} is in use by another run (pid {holder_pid(path)}); wait for it or pick another RUN_NAME"
        ) from None
    try:
        now, held = os.stat(path), os.fstat(fd)
        same = (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)
    except FileNotFoundError:
        same = False
    if not same:  # the run that held it removed it (it stopped on bad input): start over
        os.close(fd)
        return None
    return RunClaim(path, fd, created)


def holder_pid(path: Path) -> str:
    """The pid holding the flock on path, from /proc/locks (Linux); "unknown" elsewhere."""
    try:
        st = os.stat(path)
        exact = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        with open("/proc/locks") as locks:
            rows = [line.split() for line in locks if "FLOCK" in line]
    except (OSError, ValueError):
        return "unknown"
    # overlay file systems may show another device number there: the inode alone then
    for match in (lambda f: f == exact, lambda f: f.endswith(f":{st.st_ino}")):
        for fields in rows:
            hits = [i for i, f in enumerate(fields) if match(f)]
            if hits and hits[0] > 0:
                return fields[hits[0] - 1]
    return "unknown"


# ---- final/ and best/ -------------------------------------------------------------------------


def save_model(b, folder: Path, step: int | None, state_dict: dict | None = None) -> None:
    """save_pretrained + tokenizer into folder (final/ or best/), all or nothing: written into a
    temporary sibling, fsynced, marked complete, renamed into place; a folder already there is
    replaced only once the new one is whole. A failed write (a full disk) is one line naming
    what failed, what is intact and what to do. A sharded model passes its gathered state dict."""
    from train.runlog import quiet_saving

    parent = folder.parent
    for leftover in parent.glob(f".{folder.name}.*-*"):  # a killed save's (the run's lock makes it ours)
        shutil.rmtree(leftover, ignore_errors=True)
    tmp, old = parent / f".{folder.name}.tmp-{os.getpid()}", parent / f".{folder.name}.old-{os.getpid()}"
    use_cache = b.model.config.use_cache
    b.model.config.use_cache = True  # generation wants the KV cache; training turned it off
    try:
        with quiet_saving():
            b.model.save_pretrained(tmp, state_dict=state_dict)
        b.tokenizer.save_pretrained(tmp)
        (tmp / COMPLETE).write_text(json.dumps({"step": step}) + "\n")
        for path in tmp.rglob("*"):
            _fsync(path)
        _fsync(tmp)
        if folder.exists():
            os.replace(folder, old)
        os.replace(tmp, folder)
        _fsync(parent)
    except Exception as err:
        code = _errno_of(err)
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not folder.exists():
            os.replace(old, folder)
        if code is None:
            raise  # not the file system: a bug, with its traceback
        raise UsageError(write_failed(folder, code)) from None
    finally:
        b.model.config.use_cache = use_cache
    shutil.rmtree(old, ignore_errors=True)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _errno_of(err: BaseException | None) -> int | None:
    """The OS error behind err (an OSError, or safetensors' error text), or None."""
    while err is not None:
        if isinstance(err, OSError) and err.errno:
            return err.errno
        found = OS_ERROR.search(str(err))
        if found:
            return int(found.group(1))
        err = err.__cause__ or err.__context__
    return None


def write_failed(target: Path, code: int) -> str:
    """The one line for a failed write of final/, best/ or summary.json: what failed, what is
    intact, and what to do (RESUME=1 only where a checkpoint exists to resume from)."""
    from train.checkpoint import list_checkpoints

    run = target.parent
    what = "disk full" if code in DISK_FULL else "write failed"
    fix = "free space" if code in DISK_FULL else "fix that"
    saved = list_checkpoints(run / "checkpoints")
    intact = f"checkpoint {saved[0].name} is intact" if saved else "the run has no checkpoint"
    if target.name == "best" and (run / "best").exists():
        intact += " and so is the previous best/"
    if not saved:
        todo = f"{fix} and start the run again"
    elif target.name == "best":
        todo = f"{fix}, then RESUME=1 RUN_NAME={run.name} continues the run"
    else:
        todo = f"{fix}, then RESUME=1 RUN_NAME={run.name} writes final/ and summary.json"
    return f"{what}: writing {target} failed ({os.strerror(code)}); {intact}; {todo}"


def unfinished(run_path: Path, step: int) -> str | None:
    """Why a run trained to `step` is not finished, or None: a finished run has a summary.json
    with an exit_reason for that step and a complete final/ of that step."""
    try:
        summary = json.loads((run_path / "summary.json").read_text())
        reason, steps = summary.get("exit_reason"), summary.get("steps")
    except (OSError, ValueError, AttributeError):
        return "its summary.json is missing or unreadable"
    if not reason or summary.get("final_error"):
        return "its summary.json records no finished run"
    if steps != step:
        return f"its summary.json is of step {steps}"
    try:
        marker = json.loads((run_path / "final" / COMPLETE).read_text())
        held = marker.get("step")
    except (OSError, ValueError, AttributeError):
        return "its final/ is missing or incomplete"
    return None if held == step else f"its final/ holds step {held}"


class RunDir:
    """Owns one run folder: creates it, logs to train.log, appends metrics rows."""

    def __init__(self, path: Path, overwrite: bool, resume: bool = False):
        self.path = path
        try:
            if path.is_dir() and overwrite:
                # Emptied, not removed: the run's lock is on the folder itself.
                for child in path.iterdir():
                    if child.is_dir() and not child.is_symlink():
                        shutil.rmtree(child)
                    else:
                        child.unlink()
            path.mkdir(parents=True, exist_ok=True)  # claim_run_dir made (or found) it for a real run
            self._metrics = open(path / "metrics.jsonl", "a", buffering=1)
            self._log = open(path / "train.log", "a", buffering=1)
        except OSError as err:  # a read-only file system, say
            raise UsageError(
                f"OUTPUT_DIR (--output_dir): cannot write to {path} ({err.strerror or err}); pick a folder you can write to"
            ) from None
        self._point_latest()

    def _point_latest(self) -> None:
        latest = self.path.parent / "latest"
        tmp = self.path.parent / f".latest.{os.getpid()}"
        try:
            if tmp.is_symlink():
                tmp.unlink()
            tmp.symlink_to(self.path.name)
            os.replace(tmp, latest)
        except OSError:
            pass  # file systems without symlinks: runs/latest is a convenience only

    def log(self, line: str) -> None:
        self._log.write(line + "\n")

    def metrics(self, row: dict) -> None:
        self._metrics.write(json.dumps(_clean(row)) + "\n")

    def write(self, name: str, data) -> None:
        write_json(self.path / name, data)

    def close(self) -> None:
        self._metrics.close()
        self._log.close()
