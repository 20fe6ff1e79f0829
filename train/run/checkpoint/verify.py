"""What a checkpoint must pass before anything of it is used: meta.json's fields and types,
each file's size and sha256, weights whose names and shapes are this model's, an optimizer
state of this model's groups, an objective's own state that its objective takes, and the model
it was saved for (a changed MODEL_SIZE is named as that, not as a mismatch further down)."""

from __future__ import annotations

from pathlib import Path

import safetensors.torch
import torch

from train.core import files
from train.core.files import sha256_of
from train.models import DEFAULT_FAMILY, lora

WEIGHTS, STATE, META, SHARDS = "model.safetensors", "state.pt", "meta.json", "shards"


class BadCheckpoint(Exception):
    """A checkpoint that cannot be used; the message says why (one line)."""


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


def check_meta(meta, fields=META_FIELDS, where="") -> None:
    for key, kind in fields.items():
        value = meta.get(key) if isinstance(meta, dict) else None
        if isinstance(kind, dict):
            check_meta(value, kind, f"{where}{key}.")
            continue
        if kind is int and isinstance(value, float) and value.is_integer() and value >= 0:
            # WARMUP_STEPS=0 wrote warmup_samples 0.0 before it became the int 0: such runs resume
            value = meta[key] = int(value)
        if not isinstance(value, kind) or isinstance(value, bool):
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
    family = settings.get("model_family") or DEFAULT_FAMILY  # a checkpoint from before MODEL_FAMILY: GPT-2
    return f"MODEL_SIZE={size}" + (f" MODEL_FAMILY={family}" if family != DEFAULT_FAMILY else "")


def model_change(name: str, saved: dict, now: dict | None) -> str | None:
    """The line for a resume into another model than the checkpoint's, or None when the model
    is the same (or the checkpoint predates the record). Checked before the weights and the
    optimizer state, whose mismatch could only say "another model"."""
    if not now or not isinstance(saved.get("model_size"), str):
        return None
    rank = [s.get("lora_r") or None for s in (saved, now)]  # LoRA's adapters: the checkpoint's weights
    if rank[0] != rank[1]:
        return (f"RESUME=1: checkpoint {name} holds "
                f"{f'LoRA adapters of LORA_R={rank[0]}' if rank[0] else 'the whole model'}"
                f", this run has LORA_R={rank[1] or '(empty)'}; resume with LORA_R={rank[0] or '(empty)'}")
    # MODEL_SIZE picks in its family
    family = [(s.get("model_family") or DEFAULT_FAMILY) for s in (saved, now)]
    # MODEL_CONFIG / SFT: the knob is ignored
    chosen_elsewhere = saved["model_size"] == "custom" or saved.get("model_path")
    if saved["model_size"] == now.get("model_size") and (family[0] == family[1] or chosen_elsewhere):
        return None
    was, has = _model_of(saved), _model_of(now)
    return (
        f"RESUME=1: checkpoint {name} was saved by "
        f"{f'a {was} run' if was else 'a run with its own MODEL_CONFIG'}, "
        f"this run has {has or 'its own MODEL_CONFIG'}; resume with "
        f"{was or 'the MODEL_CONFIG it was saved with'}"
    )


def tokenizer_change(name: str, meta: dict, now: dict | None) -> str | None:
    """The line for a resume whose tokenizer is not the checkpoint's, or None. The checkpoint's
    weights know its tokenizer's ids: one trained on another DATA_PATH (or another
    TOKENIZER_PATH), even of the same size, maps the same text to other ids, and the run would
    train on noise, then ship that tokenizer in final/. Refused rather than kept: the checkpoint
    holds no copy of its tokenizer, and the new data would need its own token cache made with the
    old one. A checkpoint from before the digest was recorded is not checked."""
    settings = meta["settings"]
    saved, current = settings.get("tokenizer"), (now or {}).get("tokenizer")
    if saved is None or current is None or saved == current:
        return None
    was = [f"DATA_PATH={settings['data_path'] or '(the built-in corpus)'}"] if "data_path" in settings else []
    was += [f"TOKENIZER_PATH={settings['tokenizer_path']}"] if settings.get("tokenizer_path") else []
    return (
        f"RESUME=1: checkpoint {name} was trained with another tokenizer than this run's"
        f"{' (' + ', '.join(was) + ')' if was else ''}; a new DATA_PATH or TOKENIZER_PATH gives the same "
        f"text "
        "other token ids: resume with the run's DATA_PATH and TOKENIZER_PATH, or start a new run on the new "
        "data"
    )


def optimizer_change(name: str, saved: dict, now: dict | None) -> str | None:
    """The line for a resume whose optimizer state cannot carry over: another OPTIMIZER (other
    state tensors) or another FREEZE (other parameters in its groups). A checkpoint from before
    they were recorded was AdamW over every parameter."""
    for key, env, default in (("optimizer", "OPTIMIZER", "adamw"), ("freeze", "FREEZE", None)):
        was, has = saved.get(key, default), (now or {}).get(key, default)
        if now and key in now and was != has:
            return (
                f"RESUME=1: checkpoint {name} holds the optimizer state of {env}={was or '(empty)'}, this "
                f"run has "
                f"{env}={has or '(empty)'}; resume with {env}={was or '(empty)'}, or start a new run from "
                f"the run's final/ (MODEL_PATH) to change it"
            )
    return None


def check_files(path: Path, meta: dict) -> None:
    names = set(meta["files"])
    if layout(meta) == "whole" and names != {WEIGHTS, STATE}:
        raise BadCheckpoint(f"{META} does not list {WEIGHTS} and {STATE}")
    if layout(meta) == "sharded" and not (
        {STATE, f"{SHARDS}/.metadata"} <= names
        and all(n == STATE or n.startswith(f"{SHARDS}/") for n in names)
    ):
        raise BadCheckpoint(f"{META} does not list {STATE} and {SHARDS}/.metadata")
    for name, expected in meta["files"].items():
        file = files.inside(path, name)
        if file is None:  # "shards/../../etc/hostname", or a shard linked to a file elsewhere
            raise BadCheckpoint(f"{META} lists {str(name)[:80]!r}, which is not a file of the checkpoint")
        if not file.is_file():
            raise BadCheckpoint(f"{name} is missing")
        size = file.stat().st_size
        if not isinstance(expected, dict) or not isinstance(expected.get("bytes"), int):
            raise BadCheckpoint(f"{META} has no valid size for {name}")
        if size != expected["bytes"]:
            raise BadCheckpoint(f"{name} is truncated or altered ({size} bytes, {expected['bytes']} written)")
        if sha256_of(file) != expected["sha256"]:
            raise BadCheckpoint(f"{name} is corrupt (its sha256 differs from the one written)")


def read_weights(model: torch.nn.Module, file: Path) -> dict:
    """Check every name and shape against the model first, so a checkpoint of another model is
    rejected (OtherModel) before any weight is overwritten; tied weights are stored once."""
    from train.distributed import safe_load  # torch.distributed.checkpoint: imported on resume only

    try:
        tensors = safetensors.torch.load_file(file, device="cpu")
    except Exception as err:  # safetensors raises its own error type for a malformed file
        raise BadCheckpoint(f"{WEIGHTS} is not a valid safetensors file ({err})") from None
    own = lora.saved_state(model)  # with LoRA the adapters alone, as saved
    for key, tensor in tensors.items():
        if key not in own:
            raise safe_load.OtherModel(f"its weights hold {key}, which this model lacks")
        if tuple(own[key].shape) != tuple(tensor.shape):
            raise safe_load.OtherModel(f"{key} is {tuple(tensor.shape)} there but {tuple(own[key].shape)} in "
                                       f"this model")
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


def check_optimizer(saved: dict, param_groups: list[list[torch.Tensor]]) -> None:
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
            if torch.is_tensor(value) and value.dim() > 0 and not _fits(value.shape, param.shape):
                raise BadCheckpoint("optimizer state has other shapes than this model (another model)")


def _fits(state: torch.Size, param: torch.Size) -> bool:
    """The parameter's shape, or a factor of it (Adafactor's rows (R, 1) and columns (1, C))."""
    return len(state) == len(param) and all(s in (p, 1) for s, p in zip(state, param, strict=True))


OBJECTIVE = ("objective", "objective_ranks")  # state.pt's entries of an objective's own state


def check_objective(state: dict, objective) -> None:
    """state.pt's objective entries (GRPO: a generation's scored micro-batches) must load into this run's
    objective: each rank's is tried on it, then its own state put back (as the RNG states are tried). An
    objective without the hook, or a checkpoint without the entries (saved before them), is not checked."""
    entries = state.get("objective"), state.get("objective_ranks")
    if entries == (None, None) or not hasattr(objective, "load_state_dict"):
        return
    if not isinstance(entries[0], dict) or not (entries[1] is None or isinstance(entries[1], list)):
        raise BadCheckpoint(f"{STATE} holds an unusable objective state (not one state per rank)")
    own = objective.state_dict()
    try:
        for entry in [entries[0], *(entries[1] or [])]:
            objective.load_state_dict(entry)
    except ValueError as err:
        raise BadCheckpoint(f"{STATE} holds an unusable objective state ({err})") from None
    finally:
        objective.load_state_dict(own)
