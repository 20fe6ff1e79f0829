"""The run folder contract: runs/<name>/ with config.json, metrics.jsonl, summary.json,
train.log and final/; runs/latest points at the newest run."""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path

from train.core.errors import UsageError
from train.observe.tensorboard_log import NoLog


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
    """Pick the run folder without creating it: a new unique name by default; an explicit
    RUN_NAME that exists is refused unless OVERWRITE=1; RESUME=1 picks the run to continue."""
    root = Path(output_dir)
    if resume:
        from train.run.resume import find_run_dir

        return find_run_dir(root, run_name, launcher)
    if run_name is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        base = f"{launcher}-{stamp}"
        name, n = base, 1
        while (root / name).exists():
            n += 1
            name = f"{base}-{n}"
        return root / name
    path = root / run_name
    if path.exists() and not overwrite:
        raise UsageError(f"RUN_NAME={run_name}: {path} already exists; set OVERWRITE=1 to replace it, RESUME=1 to continue it, or pick another name")
    return path


class RunDir:
    """Owns one run folder: creates it, logs to train.log, appends metrics rows."""

    def __init__(self, path: Path, overwrite: bool, resume: bool = False):
        self.path = path
        if path.exists() and overwrite:
            shutil.rmtree(path)
        path.mkdir(parents=True, exist_ok=resume)  # a resumed run appends to its own folder
        self._metrics = open(path / "metrics.jsonl", "a", buffering=1)
        self._log = open(path / "train.log", "a", buffering=1)
        self._point_latest()
        self.mirror = NoLog()  # REPORT_TO: where rows are copied (observe/tensorboard_log.py)

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
