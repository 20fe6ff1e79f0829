"""The pickled parts of a checkpoint read without running any code from the run folder.

state.pt goes through torch.load(weights_only=True). A sharded checkpoint (shards/ of
SHARDING=zero2|zero3) needs more: torch.distributed.checkpoint reads shards/.metadata with plain
pickle.load, and the non-tensor entries of the shard files (the optimizer's param_groups: lr,
betas, parameter names) with torch.load(weights_only=False), so a crafted file would run code on
RESUME=1 however meta.json hashes it (the hashes can be recomputed by whoever edits the folder).
Here .metadata goes through an unpickler that resolves exactly the classes DCP's metadata is
made of and nothing else (torch's own weights-only unpickler cannot be reused: it reads pickle
protocol 2 only, DCP writes protocol 4), the non-tensor entries through
torch.load(weights_only=True), and every read must stay inside a shard file of the folder.
DCP itself reads the tensors with weights_only=True.
"""

from __future__ import annotations

import collections
import io
import pickle
import re
from pathlib import Path, PosixPath

import torch
import torch.serialization
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

METADATA = ".metadata"
# Every global a .metadata file may name, as (module, name): DCP's dataclasses (built field by
# field or by their own __setstate__), torch.Size, dtypes and layouts (looked up, not built),
# and PosixPath, the checkpoint_id DCP records. Each is harmless whatever arguments a crafted
# file passes; anything else is refused before it is even imported.
METADATA_GLOBALS = {
    (cls.__module__, cls.__qualname__): cls
    for cls in (
        Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata, BytesStorageMetadata,
        ChunkStorageMetadata, TensorProperties, _MEM_FORMAT_ENCODING, _StorageInfo,
        collections.OrderedDict, set, frozenset,
    )
}  # fmt: skip
METADATA_GLOBALS.update({
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("pathlib", "PosixPath"): PosixPath,
    **{("torch", name): value for name, value in vars(torch).items() if isinstance(value, torch.dtype)},
})  # fmt: skip
REASON_CHARS = 120


class Refused(Exception):
    """A pickled part of a checkpoint the safe loader will not read; the message says why."""


class OtherModel(Refused):
    """Weights whose names or shapes are not this model's: the settings chose another model."""


def refusal(err: BaseException) -> str:
    """One line on why the safe loader refused a file, without torch's advice to load it with
    weights_only=False (which would run the code)."""
    text = str(err)
    for marker in ("WeightsUnpickler error:", "WEIGHTS ONLY UNPICKLER ERROR:"):
        text = text.rsplit(marker, 1)[-1]
    found = re.search(r"GLOBAL ([\w.]+)", text) or re.search(r"unrecognized function (\S+)", text)
    if found:
        return f"it holds a Python object ({found.group(1)}) that could run code"
    if re.search(r"Can only (build|create new object)", text):
        return "it holds a Python object that could run code"
    if text.lstrip().startswith("Weights only load failed"):
        return "it holds more than tensors, numbers, strings and containers"
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    sentence = re.split(r"(?<=[.!?])\s", lines[0], maxsplit=1)[0].rstrip(".")
    if len(sentence) > REASON_CHARS:
        sentence = sentence[:REASON_CHARS].rsplit(" ", 1)[0].rstrip(",;:") + " ..."
    return sentence


def load_file(path: Path, name: str):
    """torch.load(weights_only=True) of a whole file; Refused with one line otherwise."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises UnpicklingError, RuntimeError, EOFError ...
        raise Refused(f"{name} refused by the safe loader: {refusal(err)}") from None


def _load_bytes(data, where: str):
    try:
        return torch.load(data, map_location="cpu", weights_only=True)
    except Exception as err:
        raise Refused(f"{where} refused by the safe loader: {refusal(err)}") from None


class _MetadataUnpickler(pickle.Unpickler):
    """find_class is the one way a pickle reaches code (GLOBAL, STACK_GLOBAL, INST, OBJ and the
    extension registry all go through it): only METADATA_GLOBALS resolve."""

    def find_class(self, module: str, name: str):
        found = METADATA_GLOBALS.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"Unsupported global: GLOBAL {module}.{name}")
        return found

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("a persistent id, which DCP metadata never holds")


def read_metadata(path: Path, where: str = f"shards/{METADATA}") -> Metadata:
    """A DCP .metadata file through the restricted unpickler (never plain pickle)."""
    try:
        with open(path, "rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
    except Exception as err:
        raise Refused(f"{where} refused by the safe loader: {refusal(err)}") from None
    if not (
        isinstance(metadata, Metadata)
        and isinstance(metadata.state_dict_metadata, dict)
        and isinstance(metadata.storage_data, dict)
    ):
        raise Refused(f"{where} is not a torch.distributed.checkpoint record")
    return metadata


def _check_storage(folder: Path, metadata: Metadata, where: str) -> None:
    """Every read DCP will make lies inside a .distcp file of this folder: no path elsewhere,
    no offset past a file's end, no stream transform (this kit writes none)."""
    # A link is not a shard file of the folder, wherever it points.
    sizes = {
        p.name: p.stat().st_size
        for p in folder.iterdir()
        if p.suffix == ".distcp" and p.is_file() and not p.is_symlink()
    }
    for index, info in metadata.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise Refused(f"{where} holds an entry that is not a storage record")
        size = sizes.get(info.relative_path) if isinstance(info.relative_path, str) else None
        if size is None:
            raise Refused(f"{where} points outside the shard files ({str(info.relative_path)[:80]!r})")
        offset, length = info.offset, info.length
        if not (isinstance(offset, int) and isinstance(length, int) and 0 <= offset and 0 <= length):
            raise Refused(f"{where} holds an invalid offset for {index.fqn}")
        if offset + length > size:
            raise Refused(f"{where} points past the end of {info.relative_path}")
        if info.transform_descriptors:
            raise Refused(f"{where} asks for stream transforms this kit never writes")


def _check_bytes(folder: Path, metadata: Metadata) -> None:
    """The non-tensor entries (what DCP itself would unpickle unrestricted), read safely now so
    a crafted one is met here, while the previous checkpoint can still be tried."""
    for index, info in metadata.storage_data.items():
        if isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            with open(folder / info.relative_path, "rb") as handle:
                handle.seek(info.offset)
                data = io.BytesIO(handle.read(info.length))
            _load_bytes(data, f"{info.relative_path} ({index.fqn})")


def _check_model(metadata: Metadata, model: torch.nn.Module) -> None:
    """Names and shapes of the saved weights against the model (FSDP2 parameters report their
    full shape), so another model's checkpoint is named as one before anything is read."""
    own = model.state_dict()
    saved = {k[len("model.") :]: v for k, v in metadata.state_dict_metadata.items() if k.startswith("model.")}
    for key, entry in saved.items():
        if key not in own:
            raise OtherModel(f"its weights hold {key}, which this model lacks")
        shape = tuple(getattr(entry, "size", ()))
        if isinstance(entry, TensorStorageMetadata) and shape != tuple(own[key].shape):
            raise OtherModel(f"{key} is {shape} there but {tuple(own[key].shape)} in this model")
    missing = [key for key in own if key not in saved]
    if missing:
        raise OtherModel(f"its weights lack {missing[0]}")


def check_shards(folder: Path, model: torch.nn.Module | None) -> None:
    """Everything of shards/ that is unpickled, read the safe way before the run folder is
    touched; raises Refused with the reason."""
    where = f"{folder.name}/{METADATA}"
    metadata = read_metadata(folder / METADATA, where)
    _check_storage(folder, metadata, where)
    _check_bytes(folder, metadata)
    if model is not None:
        _check_model(metadata, model)


class SafeReader(FileSystemReader):
    """DCP's file reader with .metadata read by the weights-only unpickler."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        metadata = read_metadata(path, f"{path.parent.name}/{path.name}")
        _check_storage(path.parent, metadata, f"{path.parent.name}/{path.name}")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # as FileSystemReader.read_metadata does
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DCP's default load planner with the non-tensor entries read by torch.load(weights_only=True)
    instead of weights_only=False."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        obj = _load_bytes(value, fqn)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def dcp_load(state: dict, folder: Path) -> None:
    """torch.distributed.checkpoint.load through SafeReader and SafePlanner; Refused with one
    line when a rank cannot read its part (DCP gathers every rank's failure)."""
    import torch.distributed.checkpoint as dcp

    # Refused here in our words; inside dcp.load the same refusal comes back wrapped in
    # DCP's own errors (it retries with per-rank metadata files, then gathers every rank's).
    check_shards(folder, None)
    try:
        dcp.load(state, storage_reader=SafeReader(str(folder)), planner=SafePlanner())
    except CheckpointException as err:  # a BaseException: Exception alone misses it
        failures = [exc for exc, _ in err.failures.values()]
        first = next((e for e in failures if isinstance(e, Refused)), failures[0] if failures else err)
        raise Refused(str(first) if isinstance(first, Refused) else refusal(first)) from None
