"""Checkpoints on disk: runs/<name>/checkpoints/step-00000120/, written so a kill at any moment
leaves the previous one intact, and read back without running any code from the run folder.

One checkpoint folder holds
  model.safetensors   the weights (safetensors: plain tensors, nothing to execute)
  state.pt            optimizer, GradScaler and RNG states, an objective's own state (torch.save; read with
                      torch.load(weights_only=True), which refuses anything but tensors,
                      numbers, strings and containers)
  meta.json           counters, data position, schedule, settings, and each file's size and
                      sha256 (so truncation or corruption is caught before anything is parsed)
It is written to checkpoints/.tmp-step-.../, every file fsynced, then renamed into place.

A sharded run (SHARDING=zero2|zero3) holds shards/ instead of model.safetensors: every rank
writes its own part of the weights and AdamW state through torch.distributed.checkpoint, and
rank 0 writes state.pt and meta.json (which lists and hashes every shard file) once all are
written. Such a checkpoint resumes with any number of processes (torch.distributed.checkpoint
reshards on load), but only into a sharded run, as a whole one resumes only into a whole run.
Its pickled parts (shards/.metadata, the shards' non-tensor entries) are read by a restricted
unpickler too, never by torch.distributed.checkpoint's own reader (train/distributed/safe_load.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch

from train.core import files
from train.core.errors import UsageError
from train.core.files import fsync
from train.models import lora
from train.run.checkpoint.rng import rng_state, set_rng_state
from train.run.checkpoint.verify import (
    META,
    OBJECTIVE,
    SHARDS,
    STATE,
    WEIGHTS,
    BadCheckpoint,
    check_files,
    check_meta,
    check_objective,
    check_optimizer,
    layout,
    model_change,
    optimizer_change,
    other_model,
    read_weights,
    sha256_of,
    tokenizer_change,
)

FORMAT = 1
NAME = re.compile(r"^step-(\d{8})$")
SPACE_MARGIN = 1.05  # safetensors/zip headers and meta.json on top of the tensor bytes


class DiskFull(UsageError):
    """Saving a checkpoint ran out of space; the previous checkpoint is intact."""


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def list_checkpoints(folder: Path) -> list[Path]:
    """Completed checkpoint folders, newest (highest step) first. Temporary folders of an
    interrupted save and folders set aside as invalid are not listed, nor a link (whatever it
    points to is not this run's); checkpoints/ itself a link is refused in one line."""
    if folder.is_symlink():
        raise files.LinkRefused(folder)
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if NAME.match(p.name) and p.is_dir() and not p.is_symlink()]
    return sorted(found, key=lambda p: int(NAME.match(p.name).group(1)), reverse=True)


def _tensor_bytes(obj) -> int:
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def objective_bytes(state: dict) -> int:
    """state.pt's bytes of an objective's scored micro-batches (GRPO mid-generation): every rank's under
    DDP, where "objective" is objective_ranks[0] again (saved once by torch.save, counted once here)."""
    ranks = state.get("objective_ranks")
    return _tensor_bytes(ranks if ranks is not None else state.get("objective"))


@dataclass
class Loaded:
    """A checkpoint that passed every check; the weights are already in the model."""

    path: Path
    meta: dict
    optimizer: dict
    scaler: dict
    rng: dict
    rng_ranks: list | None = None  # every rank's RNG states, where several processes saved
    objective: dict | None = None  # the objective's own state entries (verify.OBJECTIVE), where it has one


class CheckpointFolder:
    """Owns runs/<name>/checkpoints/: saves atomically, keeps the newest `keep`, and finds the
    newest checkpoint that passes every check, reporting each one it has to pass over."""

    def __init__(self, folder: Path, keep: int, say):
        self.folder, self.keep, self.say = Path(folder), keep, say
        self.last_saved: str | None = None

    # ---- saving -------------------------------------------------------------------------

    def needed_bytes(self, model, optimizer) -> int:
        unique = {t.data_ptr(): t for t in lora.saved_state(model).values()}
        total = sum(_tensor_bytes(t) for t in unique.values()) + _tensor_bytes(
            optimizer.state_dict()["state"]
        )
        return int(total * SPACE_MARGIN) + (1 << 16)

    def free_bytes(self) -> int:
        return shutil.disk_usage(self.folder).free

    def _make_folder(self) -> None:
        """checkpoints/, never a link (the checkpoints would be written wherever it points)."""
        if self.folder.is_symlink():
            raise files.LinkRefused(self.folder)
        self.folder.mkdir(parents=True, exist_ok=True)

    def save(self, step: int, model, optimizer, state: dict, meta: dict) -> Path:
        """Write checkpoint `step` (fresh temporary folder, fsync, rename), then drop the oldest.
        state: state.pt's entries (optimizer, scaler, rng); meta: meta.json's record."""
        self._make_folder()
        name = checkpoint_name(step)
        needed = self.needed_bytes(model, optimizer) + objective_bytes(state)
        free = self.free_bytes()
        if free < needed:
            raise self._disk_full(name, needed, free)
        tmp, writing = None, WEIGHTS
        try:
            tmp = files.fresh_folder(self.folder, f".tmp-{name}-")
            if lora.is_lora(model):  # the adapters alone: the frozen weights are MODEL_PATH's
                safetensors.torch.save_file(lora.saved_state(model), str(tmp / WEIGHTS))
            else:
                safetensors.torch.save_model(model, str(tmp / WEIGHTS))
            writing = STATE
            # Through a handle of ours: given a path, torch.save's C++ writer reports a full disk
            # or EFBIG as "unexpected pos" with no errno; given a handle, the OSError is kept.
            with open(tmp / STATE, "xb") as handle:
                torch.save(state, handle)
            writing = META
            target = self._complete(tmp, name, step, meta, [WEIGHTS, STATE])
        except Exception as err:  # safetensors (Rust) raises its "(os error 27)" as a plain Exception
            if tmp is not None:
                files.remove(tmp)
            if files.errno_of(err) in files.DISK_FULL:
                raise self._failed_write(name, writing, files.errno_of(err)) from None
            raise
        return target

    def save_sharded(self, step: int, model, optimizer, state: dict, meta: dict, world) -> Path:
        """The sharded checkpoint: every rank calls it at the same step. Rank 0 makes the
        temporary folder, every rank writes its shards into it, then rank 0 writes state.pt and
        meta.json and renames it into place; no rank goes on before the checkpoint is there."""
        from train.distributed import parallel, process_group

        name = checkpoint_name(step)
        tmp = self.folder / f".tmp-{name}-sharded"
        needed = self.needed_bytes(model, optimizer)

        def prepare():  # one name every rank knows: a leftover there (a link too) is removed first
            self._make_folder()
            free = self.free_bytes()
            if free < needed:
                raise self._disk_full(name, needed, free)
            files.remove(tmp)
            tmp.mkdir()

        process_group.on_main(world, prepare)
        try:
            parallel.save_sharded(tmp / SHARDS, model, optimizer)
            if world.is_main:
                with open(tmp / STATE, "xb") as handle:  # a handle of ours: the errno survives
                    torch.save(state, handle)  # the optimizer's state is in the shards
                shards = sorted(f"{SHARDS}/{p.name}" for p in (tmp / SHARDS).iterdir() if p.is_file())
                fsync(tmp / SHARDS)
                self._complete(tmp, name, step, meta, [*shards, STATE])
        except Exception as err:
            if world.is_main:
                files.remove(tmp)
            if files.errno_of(err) in files.DISK_FULL:
                raise self._failed_write(name, SHARDS, files.errno_of(err)) from None
            raise
        process_group.agree(None)  # a barrier: the checkpoint is complete for every rank
        self.last_saved = name
        return self.folder / name

    def _complete(self, tmp: Path, name: str, step: int, meta: dict, names: list[str]) -> Path:
        """fsync and hash the written files, write meta.json, rename the folder into place,
        point latest at it and drop the oldest checkpoints."""
        hashed = {}
        for file in names:
            fsync(tmp / file)
            hashed[file] = {"bytes": (tmp / file).stat().st_size, "sha256": sha256_of(tmp / file)}
        record = {"format": FORMAT, "step": step, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"), **meta}
        record["files"] = hashed
        files.write_json(tmp / META, record)
        fsync(tmp)
        target = self.folder / name
        # an invalid checkpoint of this step from an earlier attempt is set aside, then removed
        files.replace_folder(tmp, target)
        self.last_saved = name
        self._point_latest(name)
        self.prune()
        return target

    def _resume_advice(self) -> tuple[str, str]:
        """(what is intact, what to do) after a save that did not fit."""
        # RESUME=1 needs a checkpoint to continue from; before the first one only a rerun helps.
        saved = self.last_saved or next((p.name for p in list_checkpoints(self.folder)), None)
        if saved:
            return (
                f"the previous checkpoint {saved} is intact",
                f"free space or lower KEEP_CHECKPOINTS, then RESUME=1 RUN_NAME={self.folder.parent.name} "
                f"continues the run",
            )
        return "no checkpoint yet", "free space, then run again (OVERWRITE=1 to reuse the run folder)"

    def _disk_full(self, name: str, needed: int, free: int) -> DiskFull:
        previous, then = self._resume_advice()
        return DiskFull(
            f"disk full: checkpoint {name} needs about {needed / 2**20:,.0f} MiB in {self.folder} but "
            f"{free / 2**20:,.0f} MiB are free ({previous}); {then}"
        )

    def _failed_write(self, name: str, file: str, code: int) -> DiskFull:
        """A write that failed part-way (the space check passed, then the disk filled or the
        file-size limit hit): the file named, its temporary folder already removed."""
        previous, then = self._resume_advice()
        return DiskFull(
            f"disk full: writing checkpoint {name} failed at {file} in {self.folder} ({os.strerror(code)}); "
            f"{previous}; {then}"
        )

    def _point_latest(self, name: str) -> None:
        link, tmp = self.folder / "latest", self.folder / f".latest.{os.getpid()}"
        try:
            if tmp.is_symlink():
                tmp.unlink()
            tmp.symlink_to(name)
            os.replace(tmp, link)
        except OSError:  # checkpoints/latest is a convenience; loading scans the folder instead
            with contextlib.suppress(OSError):
                tmp.unlink()  # never left behind: one per process id would pile up

    def prune(self) -> None:
        """Keep the newest `keep` checkpoints; only called once a newer one is complete."""
        for old in list_checkpoints(self.folder)[self.keep :]:
            files.remove(old)

    def clean_temporary(self) -> None:
        """Remove what a killed save left behind (never a completed checkpoint)."""
        if self.folder.is_dir():
            for pattern in (".tmp-step-*", ".step-*.old-*", ".old-step-*"):
                for leftover in self.folder.glob(pattern):
                    files.remove(leftover)  # a link is unlinked, never followed

    # ---- loading ------------------------------------------------------------------------

    def load(
        self, path: Path, model, param_groups, sharding: str = "none", settings: dict | None = None,
        objective=None,
    ) -> Loaded:
        """Check and load one checkpoint; raises BadCheckpoint with the reason, UsageError where
        the run's settings (SHARDING, the model) do not fit it. A sharded checkpoint is checked
        here but its weights and optimizer state are read later, into the sharded model
        (RunGuard.start). objective: the run's, whose own state (if it keeps one) is checked too."""
        from train.distributed import (
            safe_load,  # torch.distributed.checkpoint: a second to import, read on resume only
        )

        try:
            meta = json.loads(files.read_text(path / META))
        except FileNotFoundError:
            raise BadCheckpoint(f"{META} is missing (an incomplete save)") from None
        except files.LinkRefused:
            raise BadCheckpoint(
                f"{META} is a link (a checkpoint's files are never read through one)"
            ) from None
        except (OSError, ValueError) as err:
            raise BadCheckpoint(f"{META} is not valid JSON ({err})") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise BadCheckpoint(f"{META} is not a format-{FORMAT} checkpoint record")
        check_meta(meta)
        changed = (
            model_change(path.name, meta["settings"], settings)
            or tokenizer_change(path.name, meta, settings)
            or optimizer_change(path.name, meta["settings"], settings)
        )
        if changed:
            raise UsageError(changed)
        now = "sharded" if sharding != "none" else "whole"
        if layout(meta) != now:
            saved = meta.get("sharding", "none")
            raise UsageError(
                f"RESUME=1: checkpoint {path.name} was saved by a SHARDING={saved} run; resume it with "
                f"SHARDING={saved} ({layout(meta)} and {now} checkpoints do not convert)"
            )
        check_files(path, meta)
        try:
            # Weights first: another model's checkpoint is named as that, not as an optimizer
            # state that does not fit.
            tensors = read_weights(model, path / WEIGHTS) if now == "whole" else None
            if now == "sharded":
                safe_load.check_shards(path / SHARDS, model)
            # weights_only: only tensors, numbers, strings and containers; a pickled object that
            # would run code on load is refused instead of executed.
            state = safe_load.load_file(path / STATE, STATE)
        except safe_load.OtherModel as err:
            raise UsageError(other_model(path.name, meta["settings"], err)) from None
        except safe_load.Refused as err:
            raise BadCheckpoint(str(err)) from None
        if not isinstance(state, dict) or not {"optimizer", "scaler", "rng"} <= set(state):
            raise BadCheckpoint(f"{STATE} does not hold optimizer, scaler and rng states")
        if now == "whole":
            check_optimizer(state["optimizer"], param_groups)
        scaler = state["scaler"]
        if not isinstance(scaler, dict) or (scaler and not {"scale", "_growth_tracker"} <= set(scaler)):
            raise BadCheckpoint(f"{STATE} holds no usable GradScaler state")
        current = rng_state()
        ranks = state.get("rng_ranks")
        try:  # applied for real once the data stream is positioned (RunGuard.start)
            for rng in [state["rng"], *(ranks if isinstance(ranks, list) else [])]:
                set_rng_state(rng)
        except Exception as err:  # any malformed entry: wrong types, sizes, missing keys
            raise BadCheckpoint(f"{STATE} holds unusable RNG states ({type(err).__name__})") from None
        finally:
            set_rng_state(current)
        check_objective(state, objective)
        if tensors is not None:
            model.load_state_dict(tensors, strict=False)
        return Loaded(
            path=path, meta=meta, optimizer=state["optimizer"], scaler=state["scaler"], rng=state["rng"],
            rng_ranks=ranks if isinstance(ranks, list) else None,
            objective={k: state[k] for k in OBJECTIVE if k in state} or None,
        )

    def newest_valid(
        self, model, param_groups, sharding: str = "none", settings: dict | None = None, objective=None
    ) -> tuple[Loaded | None, list[tuple[Path, str]]]:
        """The newest checkpoint that loads, and the (folder, reason) of each newer one that
        did not (each reported by name). settings: the run's own (RunGuard._settings)."""
        rejected = []
        for path in list_checkpoints(self.folder):
            try:
                loaded = self.load(path, model, param_groups, sharding, settings, objective)
            except BadCheckpoint as err:
                rejected.append((path, str(err)))
                self.say(f"checkpoint {path.name} cannot be used: {err}; trying the previous one")
                continue
            return loaded, rejected
        return None, rejected

    def set_aside(self, rejected: list[tuple[Path, str]]) -> None:
        """Rename invalid checkpoints newer than the one resumed from to <name>.invalid, so they
        are neither counted as the newest by the pruning nor picked by a later resume."""
        for path, _ in rejected:
            target = path.with_name(f"{path.name}.invalid")
            n = 1
            while target.exists():
                n += 1
                target = path.with_name(f"{path.name}.invalid{n}")
            os.replace(path, target)
            self.say(f"set aside {path.name} as {target.name}")
