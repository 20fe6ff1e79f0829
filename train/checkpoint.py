"""Checkpoints on disk: runs/<name>/checkpoints/step-00000120/, written so a kill at any moment
leaves the previous one intact, and read back without running any code from the run folder.

One checkpoint folder holds
  model.safetensors   the weights (safetensors: plain tensors, nothing to execute)
  state.pt            optimizer, GradScaler and RNG states (torch.save; read with
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
unpickler too, never by torch.distributed.checkpoint's own reader (train/safe_load.py).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import safetensors.torch
import torch

from train import safe_load
from train.errors import UsageError

FORMAT = 1
NAME = re.compile(r"^step-(\d{8})$")
WEIGHTS, STATE, META, SHARDS = "model.safetensors", "state.pt", "meta.json", "shards"
SPACE_MARGIN = 1.05  # safetensors/zip headers and meta.json on top of the tensor bytes


class BadCheckpoint(Exception):
    """A checkpoint that cannot be used; the message says why (one line)."""


class DiskFull(UsageError):
    """Saving a checkpoint ran out of space; the previous checkpoint is intact."""


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def list_checkpoints(folder: Path) -> list[Path]:
    """Completed checkpoint folders, newest (highest step) first. Temporary folders of an
    interrupted save and folders set aside as invalid are not listed."""
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and NAME.match(p.name)]
    return sorted(found, key=lambda p: int(NAME.match(p.name).group(1)), reverse=True)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tensor_bytes(obj) -> int:
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def rng_state() -> dict:
    """Every random-number state the run draws from, as plain tensors and numbers (numpy's
    array becomes a tensor, so weights_only loading accepts it)."""
    np_state = np.random.get_state(legacy=False)
    state = {
        "python": random.getstate(),
        "numpy": {
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        state["mps"] = torch.mps.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np_state = state["numpy"]
    key = np_state["key"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", key, np_state["pos"], np_state["has_gauss"], np_state["gauss"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "mps" in state and getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        torch.mps.set_rng_state(state["mps"])


def _rngs(rngs: list | None) -> dict:
    """state.pt's RNG entries: rank 0's (or this process's) states, and with several processes
    every rank's, so each draws its own dropout masks again after a resume (ranks whose batches
    differ in shape, as SFT's do, draw different amounts and drift apart)."""
    if not rngs:
        return {"rng": rng_state()}
    return {"rng": rngs[0], **({"rng_ranks": rngs} if len(rngs) > 1 else {})}


@dataclass
class Loaded:
    """A checkpoint that passed every check; the weights are already in the model."""

    path: Path
    meta: dict
    optimizer: dict
    scaler: dict
    rng: dict
    rng_ranks: list | None = None  # every rank's RNG states, where several processes saved


# The fields resume relies on, and their types: a hand-edited or foreign meta.json is reported
# as a bad checkpoint, never met later as a KeyError.
META_FIELDS = {
    "step": int,
    "samples": int,
    "data": {"epoch": int, "position": int, "identity": dict},
    "schedule": {"unit_samples": int, "warmup_samples": int, "budget_samples": int},
    "settings": dict,
    "counters": dict,
    "files": dict,
}


def _check_meta(meta, fields=META_FIELDS, where="") -> None:
    for key, kind in fields.items():
        value = meta.get(key) if isinstance(meta, dict) else None
        if isinstance(kind, dict):
            _check_meta(value, kind, f"{where}{key}.")
        elif not isinstance(value, kind) or isinstance(value, bool):
            raise BadCheckpoint(f"{META} has no valid {where}{key}")


def layout(meta: dict) -> str:
    """"sharded" (shards/, SHARDING=zero2|zero3) or "whole" (model.safetensors)."""
    return "sharded" if meta.get("sharding", "none") != "none" else "whole"


def _model_of(settings: dict) -> str | None:
    """The setting that chose a run's model, as the user would set it again (None: a custom
    model whose MODEL_CONFIG the checkpoint does not record)."""
    size = settings.get("model_size")
    if settings.get("model_path"):  # SFT: the model is MODEL_PATH's, at its own size
        return f"MODEL_PATH={settings['model_path']} ({size})"
    if size == "custom":
        return f"MODEL_CONFIG={settings['model_config']}" if settings.get("model_config") else None
    return f"MODEL_SIZE={size}"


def model_change(name: str, saved: dict, now: dict | None) -> str | None:
    """The line for a resume into another model than the checkpoint's, or None when the model
    is the same (or the checkpoint predates the record). Checked before the weights and the
    optimizer state, whose mismatch could only say "another model"."""
    if not now or not isinstance(saved.get("model_size"), str) or saved["model_size"] == now.get("model_size"):
        return None
    was, has = _model_of(saved), _model_of(now)
    return (
        f"RESUME=1: checkpoint {name} was saved by {f'a {was} run' if was else 'a run with its own MODEL_CONFIG'}, "
        f"this run has {has or 'its own MODEL_CONFIG'}; resume with {was or 'the MODEL_CONFIG it was saved with'}"
    )


def _check_files(path: Path, meta: dict) -> None:
    names = set(meta["files"])
    if layout(meta) == "whole" and names != {WEIGHTS, STATE}:
        raise BadCheckpoint(f"{META} does not list {WEIGHTS} and {STATE}")
    if layout(meta) == "sharded" and not (
        {STATE, f"{SHARDS}/.metadata"} <= names and all(n == STATE or n.startswith(f"{SHARDS}/") for n in names)
    ):
        raise BadCheckpoint(f"{META} does not list {STATE} and {SHARDS}/.metadata")
    for name, expected in meta["files"].items():
        file = path / name
        if not file.is_file():
            raise BadCheckpoint(f"{name} is missing")
        size = file.stat().st_size
        if not isinstance(expected, dict) or not isinstance(expected.get("bytes"), int):
            raise BadCheckpoint(f"{META} has no valid size for {name}")
        if size != expected["bytes"]:
            raise BadCheckpoint(f"{name} is truncated or altered ({size} bytes, {expected['bytes']} written)")
        if _sha256(file) != expected["sha256"]:
            raise BadCheckpoint(f"{name} is corrupt (its sha256 differs from the one written)")


def _read_weights(model: torch.nn.Module, file: Path) -> dict:
    """Check every name and shape against the model first, so a checkpoint of another model is
    rejected (OtherModel) before any weight is overwritten; tied weights are stored once."""
    try:
        tensors = safetensors.torch.load_file(file, device="cpu")
    except Exception as err:  # safetensors raises its own error type for a malformed file
        raise BadCheckpoint(f"{WEIGHTS} is not a valid safetensors file ({err})") from None
    own = model.state_dict()
    for key, tensor in tensors.items():
        if key not in own:
            raise safe_load.OtherModel(f"its weights hold {key}, which this model lacks")
        if tuple(own[key].shape) != tuple(tensor.shape):
            raise safe_load.OtherModel(f"{key} is {tuple(tensor.shape)} there but {tuple(own[key].shape)} in this model")
    loaded = {own[key].data_ptr() for key in tensors}
    missing = [key for key in own if key not in tensors and own[key].data_ptr() not in loaded]
    if missing:
        raise safe_load.OtherModel(f"its weights lack {missing[0]}")
    return tensors


def other_model(name: str, saved: dict, err: Exception) -> str:
    """The line for weights that are not this model's although the model settings read the
    same (two MODEL_CONFIG files of one name, an edited config)."""
    was = _model_of(saved)
    return (
        f"RESUME=1: checkpoint {name} holds another model than this run builds ({err}); "
        f"resume with {was or 'the MODEL_CONFIG it was saved with'}"
    )


def _check_optimizer(saved: dict, param_groups: list[list[torch.Tensor]]) -> None:
    """The saved optimizer state must fit the optimizer this run builds: same groups, same
    number of parameters, same shapes (load_state_dict alone checks only the counts)."""
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not isinstance(groups, list) or len(groups) != len(param_groups):
        raise BadCheckpoint("optimizer state does not match this model's parameter groups")
    params = [p for group in param_groups for p in group]
    for group, own in zip(groups, param_groups, strict=True):
        if len(group.get("params", [])) != len(own):
            raise BadCheckpoint("optimizer state holds a different number of parameters (another model)")
    order = [i for group in groups for i in group["params"]]
    for index, param in zip(order, params, strict=True):
        for value in saved.get("state", {}).get(index, {}).values():
            if torch.is_tensor(value) and value.dim() > 0 and tuple(value.shape) != tuple(param.shape):
                raise BadCheckpoint("optimizer state has other shapes than this model (another model)")


class CheckpointManager:
    """Owns runs/<name>/checkpoints/: saves atomically, keeps the newest `keep`, and finds the
    newest checkpoint that passes every check, reporting each one it has to pass over."""

    def __init__(self, folder: Path, keep: int, say):
        self.folder, self.keep, self.say = Path(folder), keep, say
        self.last_saved: str | None = None

    # ---- saving -------------------------------------------------------------------------

    def needed_bytes(self, model, optimizer) -> int:
        unique = {t.data_ptr(): t for t in model.state_dict().values()}
        total = sum(_tensor_bytes(t) for t in unique.values()) + _tensor_bytes(
            optimizer.state_dict()["state"]
        )
        return int(total * SPACE_MARGIN) + (1 << 16)

    def free_bytes(self) -> int:
        return shutil.disk_usage(self.folder).free

    def save(self, step: int, model, optimizer, scaler, meta: dict, rngs: list | None = None) -> Path:
        """Write checkpoint `step` (temporary folder, fsync, rename), then drop the oldest."""
        self.folder.mkdir(parents=True, exist_ok=True)
        name = checkpoint_name(step)
        needed = self.needed_bytes(model, optimizer)
        free = self.free_bytes()
        if free < needed:
            raise self._disk_full(name, needed, free)
        tmp = self.folder / f".tmp-{name}-{os.getpid()}"
        try:
            tmp.mkdir()
            safetensors.torch.save_model(model, str(tmp / WEIGHTS))
            state = {"optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(), **_rngs(rngs)}
            torch.save(state, tmp / STATE)
            target = self._complete(tmp, name, step, meta, [WEIGHTS, STATE])
        except OSError as err:
            shutil.rmtree(tmp, ignore_errors=True)
            if err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise self._disk_full(name, needed, self.free_bytes()) from None
            raise
        return target

    def save_sharded(self, step: int, model, optimizer, scaler, meta: dict, world, rngs: list | None = None) -> Path:
        """The sharded checkpoint: every rank calls it at the same step. Rank 0 makes the
        temporary folder, every rank writes its shards into it, then rank 0 writes state.pt and
        meta.json and renames it into place; no rank goes on before the checkpoint is there."""
        from train import distributed

        name = checkpoint_name(step)
        tmp = self.folder / f".tmp-{name}-sharded"
        needed = self.needed_bytes(model, optimizer)

        def prepare():
            self.folder.mkdir(parents=True, exist_ok=True)
            free = self.free_bytes()
            if free < needed:
                raise self._disk_full(name, needed, free)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()

        distributed.on_main(world, prepare)
        try:
            distributed.save_sharded(tmp / SHARDS, model, optimizer)
            if world.is_main:
                torch.save({"optimizer": {}, "scaler": scaler.state_dict(), **_rngs(rngs)}, tmp / STATE)
                shards = sorted(f"{SHARDS}/{p.name}" for p in (tmp / SHARDS).iterdir() if p.is_file())
                _fsync(tmp / SHARDS)
                self._complete(tmp, name, step, meta, [*shards, STATE])
        except Exception as err:
            if world.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise self._disk_full(name, needed, self.free_bytes()) from None
            raise
        distributed.agree(None)  # a barrier: the checkpoint is complete for every rank
        self.last_saved = name
        return self.folder / name

    def _complete(self, tmp: Path, name: str, step: int, meta: dict, names: list[str]) -> Path:
        """fsync and hash the written files, write meta.json, rename the folder into place,
        point latest at it and drop the oldest checkpoints."""
        files = {}
        for file in names:
            _fsync(tmp / file)
            files[file] = {"bytes": (tmp / file).stat().st_size, "sha256": _sha256(tmp / file)}
        record = {"format": FORMAT, "step": step, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"), **meta}
        record["files"] = files
        (tmp / META).write_text(json.dumps(record, indent=2) + "\n")
        _fsync(tmp / META)
        _fsync(tmp)
        target = self.folder / name
        if target.exists():  # an invalid checkpoint of this step from an earlier attempt
            aside = self.folder / f".old-{name}-{os.getpid()}"
            os.replace(target, aside)
            shutil.rmtree(aside, ignore_errors=True)
        os.replace(tmp, target)
        _fsync(self.folder)
        self.last_saved = name
        self._point_latest(name)
        self.prune()
        return target

    def _disk_full(self, name: str, needed: int, free: int) -> DiskFull:
        # RESUME=1 needs a checkpoint to continue from; before the first one only a rerun helps.
        saved = self.last_saved or next((p.name for p in list_checkpoints(self.folder)), None)
        if saved:
            previous, then = f"the previous checkpoint {saved} is intact", "free space or lower KEEP_CHECKPOINTS, then RESUME=1"
        else:
            previous, then = "no checkpoint yet", "free space, then run again (OVERWRITE=1 to reuse the run folder)"
        return DiskFull(
            f"disk full: checkpoint {name} needs about {needed / 2**20:,.0f} MiB in {self.folder} but "
            f"{free / 2**20:,.0f} MiB are free ({previous}); {then}"
        )

    def _point_latest(self, name: str) -> None:
        link, tmp = self.folder / "latest", self.folder / f".latest.{os.getpid()}"
        try:
            if tmp.is_symlink():
                tmp.unlink()
            tmp.symlink_to(name)
            os.replace(tmp, link)
        except OSError:
            pass  # checkpoints/latest is a convenience; loading scans the folder instead

    def prune(self) -> None:
        """Keep the newest `keep` checkpoints; only called once a newer one is complete."""
        for old in list_checkpoints(self.folder)[self.keep :]:
            shutil.rmtree(old, ignore_errors=True)

    def clean_temporary(self) -> None:
        """Remove what a killed save left behind (never a completed checkpoint)."""
        if self.folder.is_dir():
            for leftover in self.folder.glob(".tmp-step-*"):
                shutil.rmtree(leftover, ignore_errors=True)
            for leftover in self.folder.glob(".old-step-*"):
                shutil.rmtree(leftover, ignore_errors=True)

    # ---- loading ------------------------------------------------------------------------

    def load(self, path: Path, model, param_groups, sharding: str = "none", settings: dict | None = None) -> Loaded:
        """Check and load one checkpoint; raises BadCheckpoint with the reason, UsageError where
        the run's settings (SHARDING, the model) do not fit it. A sharded checkpoint is checked
        here but its weights and optimizer state are read later, into the sharded model
        (RunGuard.start)."""
        try:
            meta = json.loads((path / META).read_text())
        except FileNotFoundError:
            raise BadCheckpoint(f"{META} is missing (an incomplete save)") from None
        except (OSError, ValueError) as err:
            raise BadCheckpoint(f"{META} is not valid JSON ({err})") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise BadCheckpoint(f"{META} is not a format-{FORMAT} checkpoint record")
        _check_meta(meta)
        changed = model_change(path.name, meta["settings"], settings)
        if changed:
            raise UsageError(changed)
        now = "sharded" if sharding != "none" else "whole"
        if layout(meta) != now:
            saved = meta.get("sharding", "none")
            raise UsageError(
                f"RESUME=1: checkpoint {path.name} was saved by a SHARDING={saved} run; resume it with "
                f"SHARDING={saved} ({layout(meta)} and {now} checkpoints do not convert)"
            )
        _check_files(path, meta)
        try:
            # Weights first: another model's checkpoint is named as that, not as an optimizer
            # state that does not fit.
            tensors = _read_weights(model, path / WEIGHTS) if now == "whole" else None
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
            _check_optimizer(state["optimizer"], param_groups)
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
        if tensors is not None:
            model.load_state_dict(tensors, strict=False)
        return Loaded(
            path=path, meta=meta, optimizer=state["optimizer"], scaler=state["scaler"], rng=state["rng"],
            rng_ranks=ranks if isinstance(ranks, list) else None,
        )

    def newest_valid(
        self, model, param_groups, sharding: str = "none", settings: dict | None = None
    ) -> tuple[Loaded | None, list[tuple[Path, str]]]:
        """The newest checkpoint that loads, and the (folder, reason) of each newer one that
        did not (each reported by name). settings: the run's own (RunGuard._settings)."""
        rejected = []
        for path in list_checkpoints(self.folder):
            try:
                loaded = self.load(path, model, param_groups, sharding, settings)
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
