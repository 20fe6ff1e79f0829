"""A bare checkpoint read into a transformers model: a torch state_dict file (`*.bin`, `*.pt`,
`*.safetensors`) beside a config (config.json, or model_config.json as ChatLM-mini-Chinese
writes it), the form many training scripts save with torch.save(model.state_dict()).

transformers loads only its own file names (model.safetensors, pytorch_model.bin ...), so such a
folder used to fail deep in from_pretrained. Here: the config is read as JSON (never any code it
names: an auto_map is dropped, the model is the plain class of its model_type), the weights with
safetensors or torch.load(weights_only=True), a prefix a wrapper added ("module." of DDP, "model."
of a wrapper module) is taken off, and the keys and shapes must be the config's; every failure is
one UsageError line naming what is missing.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from train.core.device import memory_capacity
from train.core.errors import UsageError
from train.core.remote_code import names_code
from train.models import build, checks
from train.models.checks import refuse_unbuilt

# transformers' own weight names: a folder with one of these loads with from_pretrained.
HF_WEIGHTS = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
CONFIG_NAMES = ("config.json", "model_config.json")
# Wrappers' prefixes on every key: DDP's module., a wrapper nn.Module's model., torch.compile's _orig_mod.
PREFIXES = ("module.", "model.", "_orig_mod.")
# Where a training script nests the state_dict inside what it saved.
NESTED = ("state_dict", "model_state_dict", "model", "module")
SHOWN = 3  # keys named in a mismatch line


def config_file(folder: Path) -> Path | None:
    return next((folder / n for n in CONFIG_NAMES if (folder / n).is_file()), None)


def has_hf_weights(folder: Path) -> bool:
    return any((folder / name).is_file() for name in HF_WEIGHTS)


def weight_files(folder: Path) -> list[Path]:
    """State-dict files of a folder: *.safetensors / *.bin / *.pt / *.pth (training_args.bin,
    optimizer and scheduler state are not weights)."""
    skip = ("training_args", "optimizer", "scheduler", "rng_state")
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES
                  and not p.name.startswith(skip))  # fmt: skip


def bare_checkpoint(path: Path, variable: str, plain: bool = False) -> SimpleNamespace | None:
    """(weights, config) of a bare checkpoint at path (a folder, or a weights file whose folder
    holds the config); None for a transformers folder (its own weight names). A folder with
    neither is one line. plain: a transformers folder whose config names code of its own
    (ChatLM's hub folder: auto_map over a plain T5) counts as bare, to be read as its model_type."""
    path = Path(path)
    folder = path.parent if path.is_file() else path
    config = config_file(folder)
    if path.is_file():
        weights = [path]
    elif has_hf_weights(folder) and not (plain and config is not None and names_code(config)):
        return None
    else:
        weights = weight_files(folder)
    if config is None:
        raise UsageError(f"{variable}={path}: no config.json or model_config.json beside the weights")
    if not weights:
        raise UsageError(
            f"{variable}={path}: no weights file (model.safetensors, pytorch_model.bin, or a state_dict "
            f"{' / '.join('*' + s for s in WEIGHT_SUFFIXES)})"
        )
    if len(weights) > 1:
        names = ", ".join(p.name for p in weights[:SHOWN])
        raise UsageError(f"{variable}={path}: several weights files ({names}); name the one to use: "
                         f"python -m train import {folder}/<file> DEST")  # fmt: skip
    return SimpleNamespace(weights=weights[0], config=config)


def raw_config(file: Path) -> dict:
    """A config file as a dict; ChatLM's model_config.json is a T5Config dict, and an old one may
    lack model_type. Raises OSError / ValueError for an unreadable or non-object file."""
    raw = checks.load_json(file.read_text(encoding="utf-8"))
    if not isinstance(raw, dict):
        raise ValueError("not a JSON object")
    if file.name == "model_config.json" and "model_type" not in raw and "d_model" in raw:
        raw["model_type"] = "t5"
    return raw


def read_config(file: Path, variable: str):
    """The transformers config of a bare checkpoint: model_type's own class, no auto_map."""
    try:
        raw = raw_config(file)
    except (OSError, ValueError) as err:
        raise UsageError(f"{variable}: {file} is not a readable JSON object ({err})") from None
    for key in ("auto_map", "architectures", "_name_or_path", "transformers_version"):
        raw.pop(key, None)  # the folder's own classes are never imported: the plain model_type's
    model_type = raw.pop("model_type", None)
    checks.refuse_unknown_type(model_type, f"{variable}: {file.name}")
    checks.check_raw(raw, f"{variable}: {file.name}")
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.for_model(model_type, **raw)
    except Exception as err:  # ValueError, TypeError, huggingface_hub's validation errors
        raise UsageError(
            f"{variable}: {file} is not a {model_type} config ({str(err).splitlines()[0]})"
        ) from None
    checks.refuse_other_kinds(cfg, f"{variable}: {file.name}")
    checks.check_shape(cfg, f"{variable}: {file.name}")
    return cfg


def read_weights(file: Path, variable: str) -> dict[str, torch.Tensor]:
    """The tensors of a state_dict file, never unpickling code."""
    if file.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            tensors = load_file(str(file))
        except Exception as err:  # SafetensorError, OSError
            raise UsageError(f"{variable}: {file} is not a readable safetensors file ({err})") from None
    else:
        try:
            tensors = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as err:  # UnpicklingError, RuntimeError, EOFError ...
            first = (str(err).strip().splitlines() or [type(err).__name__])[0][:160]
            raise UsageError(
                f"{variable}: {file} is refused by torch.load(weights_only=True), which the kit uses so that "
                f"no "
                f"code in a pickle runs ({first}); save the weights with torch.save(model.state_dict()) or "
                f"as safetensors"
            ) from None
    return _tensors_of(tensors, file, variable)


def _tensors_of(obj, file: Path, variable: str) -> dict[str, torch.Tensor]:
    if isinstance(obj, dict) and not all(isinstance(v, torch.Tensor) for v in obj.values()):
        inner = next((obj[k] for k in NESTED if isinstance(obj.get(k), dict)), None)
        obj = inner if inner is not None else obj
    if not isinstance(obj, dict) or not obj or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise UsageError(
            f"{variable}: {file} does not hold a state_dict (a dict of parameter name -> tensor)"
        )
    return obj


def strip_prefix(tensors: dict, expected: set[str]) -> tuple[dict, str]:
    """tensors without a wrapper's prefix on every key, where that matches the model better
    (Llama's own keys start with "model."); and the prefix taken off ("" for none)."""
    taken = ""
    while True:
        keys = set(tensors)
        for prefix in PREFIXES:
            if all(k.startswith(prefix) for k in keys):
                stripped = {k[len(prefix):]: v for k, v in tensors.items()}
                if len(set(stripped) & expected) > len(keys & expected):
                    tensors, taken = stripped, taken + prefix
                    break
        else:
            return tensors, taken


def _shown(keys) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:SHOWN]) + (f" and {len(keys) - SHOWN} more" if len(keys) > SHOWN else "")


def check_keys(model, tensors: dict, file: Path, variable: str) -> None:
    """The state_dict's names and shapes are the model's; a tied copy (T5's embed_tokens and
    lm_head share shared.weight) may be absent, as save_pretrained leaves it out."""
    own = model.state_dict()
    storage = {k: v.data_ptr() for k, v in own.items()}  # tied names share one tensor
    given = {storage[k] for k in tensors if k in storage}
    missing = [k for k in own if k not in tensors and storage[k] not in given]
    unexpected = [k for k in tensors if k not in own]
    if missing or unexpected:
        parts = [
            f"missing {_shown(missing)}" if missing else "",
            f"unexpected {_shown(unexpected)}" if unexpected else "",
        ]
        raise UsageError(f"{variable}: {file.name}'s keys do not match its config "
                         f"({'; '.join(p for p in parts if p)})")
    for key, value in tensors.items():
        if tuple(value.shape) != tuple(own[key].shape):
            raise UsageError(
                f"{variable}: {file.name}: {key} has shape {tuple(value.shape)}, its config makes "
                f"{tuple(own[key].shape)} (vocab_size, d_model ... differ from the weights)"
            )
        if own[key].is_floating_point() and not value.is_floating_point():
            # load_state_dict would cast int64 / complex to float without a word (complex: its real part)
            raise UsageError(
                f"{variable}: {file.name}: {key} is {str(value.dtype).removeprefix('torch.')}, not a "
                f"floating-point "
                "tensor: not the weights of this model (save them as they were trained, float32/16 or "
                "bfloat16)"
            )
    refuse_non_finite(tensors, f"{variable}: {file.name}")


def refuse_non_finite(tensors: dict, where: str) -> None:
    """One line naming the first tensor holding NaN or inf: weights that can only train NaN
    (every loss non-finite from the first step) and be saved as such."""
    for key, value in tensors.items():
        if value.is_floating_point() and (bad := non_finite(value)):
            raise UsageError(f"{where}: {key} holds {bad:,} non-finite value(s) (NaN or inf); "
                             "these weights cannot be trained or used")  # fmt: skip


NATIVE = (torch.float32, torch.float64, torch.float16, torch.bfloat16)  # dtypes torch.isfinite takes
CHUNK = 1 << 24  # elements upcast at a time: 64 MB of float32


def non_finite(value: torch.Tensor) -> int:
    """NaN and inf values in a floating tensor. torch.isfinite has no float8 kernel (a float8
    checkpoint was a NotImplementedError here): those are upcast a chunk at a time, never whole
    (float32 is 4x a float8 tensor's size)."""
    if value.dtype in NATIVE:
        return 0 if bool(torch.isfinite(value).all()) else int((~torch.isfinite(value)).sum())
    flat = value.reshape(-1)
    return sum(int((~torch.isfinite(flat[i:i + CHUNK].float())).sum()) for i in range(0, flat.numel(), CHUNK))


def load_bare(found: SimpleNamespace, variable: str, say=print):
    """(model in float32, the weights' own floating dtype) of a bare checkpoint (bare_checkpoint's
    answer)."""
    cfg = read_config(found.config, variable)
    # Built in float32 in host memory whatever the device: a config asking for more is one line here.
    refuse_unbuilt(cfg, f"{variable}: {found.config.name}", memory_capacity(torch.device("cpu")))
    tensors = read_weights(found.weights, variable)
    cfg.use_cache = False
    with torch.random.fork_rng(devices=[]):  # the run's seeded RNG stays as it was: every weight is replaced
        model = build.build_model(cfg, gradient_checkpointing=False, seed=0)
    tensors, prefix = strip_prefix(tensors, set(model.state_dict()))
    check_keys(model, tensors, found.weights, variable)
    model.load_state_dict(tensors, strict=False)  # tied copies absent from the file are tied below
    model.tie_weights()
    # trained weights from a folder (LoRA adapts only such models)
    model.name_or_path = str(found.weights.parent)
    took = f", key prefix {prefix!r} taken off" if prefix else ""
    say(f"{variable}: imported {found.weights.name} with {found.config.name} as {type(model).__name__}{took}")
    floats = [v.dtype for v in tensors.values() if v.is_floating_point()]
    return model, max(set(floats), key=floats.count) if floats else torch.float32
