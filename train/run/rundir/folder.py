"""The run folder contract: runs/<name>/ with config.json, metrics.jsonl, summary.json,
train.log and final/; runs/latest points at the newest completed run (point_latest, once its
final/ and summary.json agree), so `make chat` never meets a run in progress.

One run per folder at a time: a run claims its folder before anything is built (a new one made
atomically by mkdir) and holds an flock on it until it ends or its process dies. final/ and
best/ are written whole or not at all and carry a marker with their step, so a run counts as
finished only when summary.json and a complete final/ of the same step agree."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

from train.core import files
from train.core.errors import UsageError
from train.core.files import DISK_FULL, errno_of, json_safe
from train.distributed import process_group
from train.models import lora
from train.observe.tensorboard_log import NoLog

COMPLETE = ".complete"  # written last into final/ and best/: {"step": N}


def write_json(path: Path, data) -> None:
    """Whole or not at all, never through a link (train/core/files.py)."""
    files.write_json(path, data)


def save_model(plan, folder: Path, step: int | None, state_dict: dict | None = None) -> None:
    """save_pretrained + tokenizer into folder (final/ or best/), all or nothing: written into a
    fresh temporary sibling, fsynced, marked complete, renamed into place; a folder already there
    is replaced only once the new one is whole (a link there is removed, never followed). A failed
    write (a full disk) is one line naming what failed, what is intact and what to do. A sharded
    model passes its gathered state dict."""
    from train.core.model import quiet_saving

    parent = folder.parent
    for leftover in parent.glob(f".{folder.name}.*-*"):  # a killed save's (the run's lock makes it ours)
        files.remove(leftover)  # a link is unlinked, never followed
    tmp = None
    # Generation wants the KV cache (16x faster for 400 tokens); training turned it off, and
    # generate() reads generation_config.json, made from the config when the model was built.
    gen = getattr(plan.model, "generation_config", None) or SimpleNamespace(use_cache=None)
    use_cache, gen_cache = plan.model.config.use_cache, gen.use_cache
    plan.model.config.use_cache = gen.use_cache = True
    try:
        tmp = files.fresh_folder(parent, f".{folder.name}.tmp-")
        with quiet_saving():
            if lora.is_lora(plan.model):  # merged, loadable without peft; the adapter in tmp/adapter
                lora.save_merged(plan.model, tmp, folder)
            else:
                plan.model.save_pretrained(tmp, state_dict=state_dict)
        plan.tokenizer.save_pretrained(tmp)
        files.atomic_write(tmp / COMPLETE, json.dumps({"step": step}) + "\n")
        files.sync_tree(tmp)
        files.replace_folder(tmp, folder)
    except Exception as err:
        code = errno_of(err)
        if tmp is not None:
            files.remove(tmp)
        if code is None:
            raise  # not the file system: a bug, with its traceback
        raise UsageError(write_failed(folder, code)) from None
    finally:
        plan.model.config.use_cache, gen.use_cache = use_cache, gen_cache


CONTINUES = ("best", "metrics.jsonl", "train.log")  # a failure there leaves the training to continue


def write_failed(target: Path, code: int) -> str:
    """The one line for a failed write of final/, best/, summary.json or an append to
    metrics.jsonl / train.log: what failed, what is intact, and what to do (RESUME=1 only where a
    checkpoint exists to resume from)."""
    from train.run.checkpoint.on_disk import list_checkpoints

    run = target.parent
    what = "disk full" if code in DISK_FULL else "write failed"
    how = "appending to" if target.suffix in (".jsonl", ".log") else "writing"
    fix = "free space" if code in DISK_FULL else "fix that"
    saved = list_checkpoints(run / "checkpoints")
    intact = f"checkpoint {saved[0].name} is intact" if saved else "the run has no checkpoint"
    if target.name == "best" and (run / "best").exists():
        intact += " and so is the previous best/"
    if how == "appending to":
        intact = f"its rows are whole; {intact}"
    if not saved:
        todo = f"{fix} and start the run again"
    elif target.name in CONTINUES:
        todo = f"{fix}, then RESUME=1 RUN_NAME={run.name} continues the run"
    else:
        todo = f"{fix}, then RESUME=1 RUN_NAME={run.name} writes final/ and summary.json"
    return f"{what}: {how} {target} failed ({os.strerror(code)}); {intact}; {todo}"


def unfinished(run_path: Path, step: int) -> str | None:
    """Why a run trained to `step` is not finished, or None: a finished run has a summary.json
    with an exit_reason for that step and a complete final/ of that step."""
    try:  # never read through a link: one planted there is replaced when the summary is written
        summary = json.loads(files.read_text(run_path / "summary.json"))
        reason, steps = summary.get("exit_reason"), summary.get("steps")
    except (OSError, ValueError, AttributeError, files.LinkRefused):
        return "its summary.json is missing or unreadable"
    if not reason or summary.get("final_error") or summary.get("write_error"):
        return "its summary.json records no finished run"
    if steps != step:
        return f"its summary.json is of step {steps}"
    marker = files.inside(run_path, f"final/{COMPLETE}")  # None: final/ or its marker is a link
    try:
        held = json.loads(files.read_text(marker)).get("step") if marker else None
    except (OSError, ValueError, AttributeError):
        held = None
    if held is None:
        return "its final/ is missing or incomplete"
    return None if held == step else f"its final/ holds step {held}"


def point_latest(run_path: Path) -> None:
    """runs/latest -> run_path, where the run is finished (unfinished() is None): moved at the end,
    not the start, so `make chat` / `--model runs/latest/final` never meet a run in progress
    (RESUME=1 finds its run by config.json's launcher, not by this link)."""
    try:
        steps = json.loads(files.read_text(run_path / "summary.json")).get("steps")
    except (OSError, ValueError, AttributeError, files.LinkRefused):
        return
    if unfinished(run_path, steps) is not None:
        return
    latest = run_path.parent / "latest"
    tmp = run_path.parent / f".latest.{os.getpid()}"
    try:
        if tmp.is_symlink():
            tmp.unlink()
        tmp.symlink_to(run_path.name)
        os.replace(tmp, latest)
    except OSError:  # file systems without symlinks: runs/latest is a convenience only
        with contextlib.suppress(OSError):
            tmp.unlink()  # never left behind: one per process id would pile up


class RunDir:
    """Owns one run folder: creates it, logs to train.log, appends metrics rows. Neither file is
    opened through a link (refused in one line). An append that fails (a full disk) is not
    raised where it happened, in the middle of a step: the file keeps its whole rows and takes
    no more, `failed` holds the first failure's line, and the loop stops at its next log step
    (stop_for_write) with summary.json written where the disk still takes it."""

    def __init__(self, path: Path, overwrite: bool, resume: bool = False, mirror=None):
        """mirror: (run path) -> where rows are copied (REPORT_TO, observe/tensorboard_log.py),
        made once the folder is emptied (OVERWRITE=1) so that its files survive."""
        self.path = path
        self.failed: str | None = None
        try:
            if path.is_dir() and overwrite:
                # Emptied, not removed: the run's lock is on the folder itself.
                for child in path.iterdir():
                    if child.is_dir() and not child.is_symlink():
                        shutil.rmtree(child)
                    else:
                        child.unlink()  # a link itself, never what it points to
            path.mkdir(parents=True, exist_ok=True)  # claim_run_dir made (or found) it for a real run
            self._metrics = files.open_append(path / "metrics.jsonl")
            self._log = files.open_append(path / "train.log")
        except OSError as err:  # a read-only file system, say (a link there: LinkRefused, one line)
            raise UsageError(
                f"OUTPUT_DIR (--output_dir): cannot write to {path} ({err.strerror or err}); pick a folder "
                f"you can write to"
            ) from None
        self.mirror = mirror(path) if mirror else NoLog()

    def _append(self, handle: files.Appender, text: str) -> None:
        if handle.fd is None:  # failed before: a later row would leave a gap in the record
            return
        try:
            handle.write(text)
        except OSError as err:
            handle.close()
            if self.failed is None:
                self.failed = write_failed(handle.path, err.errno or 0)

    def log(self, line: str) -> None:
        self._append(self._log, line + "\n")

    def metrics(self, row: dict) -> None:
        self._append(self._metrics, json.dumps(json_safe(row)) + "\n")
        self.mirror.row(row)

    def write(self, name: str, data) -> None:
        write_json(self.path / name, data)

    def close(self) -> None:
        self._metrics.close()
        self._log.close()


def stop_for_write(world: process_group.Dist, run_dir) -> bool:
    """True on every rank once rank 0 could not append to metrics.jsonl or train.log (ranks
    stop at the same step, or one waits forever in a collective)."""
    return bool(process_group.max_across(world, [int(run_dir.failed is not None)])[0])


class NullRunDir:
    """What ranks other than 0 write: nothing. Same methods as RunDir."""

    failed = None  # rank 0's RunDir holds the line of a failed append

    def __init__(self, path: Path):
        self.path = path

    def log(self, line: str) -> None:
        pass

    def metrics(self, row: dict) -> None:
        pass

    def write(self, name: str, data) -> None:
        pass

    def close(self) -> None:
        pass
