"""Which run folder a run gets, and that it has it alone: a new name reserved atomically
(mkdir, so two runs started in the same second get two folders), RUN_NAME refused when it
exists unless OVERWRITE=1 or RESUME=1, the folder RESUME=1 continues, and a lock (flock) held
for the run's life that a second run on the same folder respects."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from train.core.errors import UsageError
from train.run.checkpoint.on_disk import list_checkpoints

try:
    import fcntl
except ImportError:  # no flock (Windows): runs are not locked there
    fcntl = None


def plan_run_dir(
    output_dir: str, run_name: str | None, launcher: str, overwrite: bool, resume: bool = False
) -> Path:
    """Pick the run folder without creating it (dry runs, doctor): a new unique name by default;
    an explicit RUN_NAME that exists is refused unless OVERWRITE=1; RESUME=1 picks the run to
    continue. A real run takes its folder with claim_run_dir."""
    root = Path(output_dir)
    _refuse_link(root, run_name)
    if resume:
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


def _refuse_link(root: Path, run_name: str | None) -> None:
    """RUN_NAME naming a link (runs/latest, or one planted): OVERWRITE=1 would empty, and the run
    would write, wherever it points."""
    if run_name is not None and (root / run_name).is_symlink():
        raise UsageError(
            f"RUN_NAME={run_name}: {root / run_name} is a symbolic link; a run folder is never used through "
            f"one (set RUN_NAME to the folder it points to)"
        )


def _default_name(launcher: str) -> str:
    return f"{launcher}-{time.strftime('%Y%m%d-%H%M%S')}"


def _exists(run_name: str, path: Path) -> UsageError:
    return UsageError(
        f"RUN_NAME={run_name}: {path} already exists; set OVERWRITE=1 to replace it, RESUME=1 to continue "
        f"it, or pick another name"
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


def claim_run_dir(
    output_dir: str, run_name: str | None, launcher: str, overwrite: bool, resume: bool = False
) -> RunClaim:
    """plan_run_dir's rules without its race: a new folder is made by mkdir, which fails when
    another run made it first (then the next free name, or the refusal of an existing RUN_NAME),
    and every folder is locked; one that a live run holds is refused, naming its pid."""
    root = Path(output_dir)
    label = f"RUN_NAME={run_name}" if run_name else "RESUME=1"
    _refuse_link(root, run_name)
    if resume:
        try:
            path = plan_run_dir(output_dir, run_name, launcher, overwrite, resume)
        except UsageError:
            if run_name is not None and (root / run_name).is_dir():  # a live run before its first save:
                _refuse_if_busy(root / run_name, label)  # "in use", not "no checkpoint"
            raise
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


def _refuse_if_busy(path: Path, label: str) -> None:
    """The "in use by another run (pid N)" line where a live run holds path; else nothing."""
    busy = _lock(path, [], label)  # raises when another run holds it
    if busy is not None:
        busy.release()


def _claim_once(
    root: Path, run_name: str | None, launcher: str, overwrite: bool, label: str
) -> RunClaim | None:
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
            _refuse_if_busy(path, label)  # a live run's folder: say that, not "exists"
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
    return UsageError(f"OUTPUT_DIR (--output_dir): cannot create {path} ({reason}); pick a folder you can "
                      f"write to")


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
            f"{label}: {path} is in use by another run (pid {holder_pid(path)}); wait for it or pick another "
            f"RUN_NAME"
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


def find_run_dir(root: Path, run_name: str | None, launcher: str) -> Path:
    """The run folder RESUME=1 continues: runs/RUN_NAME, or the newest run of this launcher
    that has a checkpoint. Checked before anything is built or written."""
    if run_name is not None:
        path = root / run_name
        if not path.is_dir():
            raise UsageError(
                f"RESUME=1: {path} does not exist (RUN_NAME={run_name}); leave RESUME empty to start it"
            )
        if not list_checkpoints(path / "checkpoints"):
            raise UsageError(
                f"RESUME=1: {path} has no checkpoint (it stopped before its first save; SAVE_EVERY sets how "
                f"often)"
            )
        return path
    candidates = []
    for config_file in root.glob("*/config.json"):
        try:
            started_by = json.loads(config_file.read_text())["config"]["run"]["launcher"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        saved = list_checkpoints(config_file.parent / "checkpoints")
        if started_by == launcher and saved:
            candidates.append((max(p.stat().st_mtime for p in saved), config_file.parent.name))
    if not candidates:
        raise UsageError(
            f"RESUME=1: no run of {launcher} in {root} has a checkpoint; set RUN_NAME to the run to continue"
        )
    return root / max(candidates)[1]
