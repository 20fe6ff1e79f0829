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
from pathlib import Path
from types import SimpleNamespace

from train.core.errors import UsageError
from train.core.files import fsync
from train.observe.tensorboard_log import NoLog

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


def save_model(b, folder: Path, step: int | None, state_dict: dict | None = None) -> None:
    """save_pretrained + tokenizer into folder (final/ or best/), all or nothing: written into a
    temporary sibling, fsynced, marked complete, renamed into place; a folder already there is
    replaced only once the new one is whole. A failed write (a full disk) is one line naming
    what failed, what is intact and what to do. A sharded model passes its gathered state dict."""
    from train.run.runlog import quiet_saving

    parent = folder.parent
    for leftover in parent.glob(f".{folder.name}.*-*"):  # a killed save's (the run's lock makes it ours)
        shutil.rmtree(leftover, ignore_errors=True)
    tmp, old = parent / f".{folder.name}.tmp-{os.getpid()}", parent / f".{folder.name}.old-{os.getpid()}"
    # Generation wants the KV cache (16x faster for 400 tokens); training turned it off, and
    # generate() reads generation_config.json, made from the config when the model was built.
    gen = getattr(b.model, "generation_config", None) or SimpleNamespace(use_cache=None)
    use_cache, gen_cache = b.model.config.use_cache, gen.use_cache
    b.model.config.use_cache = gen.use_cache = True
    try:
        with quiet_saving():
            b.model.save_pretrained(tmp, state_dict=state_dict)
        b.tokenizer.save_pretrained(tmp)
        (tmp / COMPLETE).write_text(json.dumps({"step": step}) + "\n")
        for path in tmp.rglob("*"):
            fsync(path)
        fsync(tmp)
        if folder.exists():
            os.replace(folder, old)
        os.replace(tmp, folder)
        fsync(parent)
    except Exception as err:
        code = _errno_of(err)
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not folder.exists():
            os.replace(old, folder)
        if code is None:
            raise  # not the file system: a bug, with its traceback
        raise UsageError(write_failed(folder, code)) from None
    finally:
        b.model.config.use_cache, gen.use_cache = use_cache, gen_cache
    shutil.rmtree(old, ignore_errors=True)


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
    from train.run.checkpoint import list_checkpoints

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

    def __init__(self, path: Path, overwrite: bool, resume: bool = False, mirror=None):
        """mirror: (run path) -> where rows are copied (REPORT_TO, observe/tensorboard_log.py),
        made once the folder is emptied (OVERWRITE=1) so that its files survive."""
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
        self.mirror = mirror(path) if mirror else NoLog()

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
        self.mirror.row(row)

    def write(self, name: str, data) -> None:
        write_json(self.path / name, data)

    def close(self) -> None:
        self._metrics.close()
        self._log.close()
