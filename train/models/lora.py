"""LoRA through peft (LORA_R, LORA_ALPHA, LORA_DROPOUT, LORA_TARGETS): the layers an architecture
adapts by default, the wrap that freezes the model and adds the adapters (before the optimizer and
DDP, so only the adapters get gradients and AdamW state), and what a LoRA model saves:
  a checkpoint   the adapters alone (the frozen weights are MODEL_PATH's, loaded again on resume)
  final/         the merged model (W + scale x B A): plain transformers, loads without peft
  final/adapter  peft's own files (adapter_config.json, adapter_model.safetensors), for
                 PeftModel.from_pretrained(base, final/adapter)
The model the run trains is the transformers model itself with peft's layers inside it (peft's
wrapper holds the same modules), so the step, DDP and the chunked loss see a PreTrainedModel.
"""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import torch

from train.core.errors import UsageError
from train.models.family import family_of
from train.models.freeze import Trainable, trainable_of

ADAPTER = "default"  # peft's adapter name: its keys carry it in the model, not in the saved files
# LORA_DROPOUT's default (peft's examples use 0.05 to 0.1; peft's and LLaMA-Factory's own default is 0)
DROPOUT = 0.05
ADAPTER_FOLDER = "adapter"
BASE_FOLDER = "base"  # in the adapter folder: the resized base it applies to (save_adapter)
GPT2 = ("c_attn", "c_proj", "c_fc")  # Conv1D layers: weights stored (in, out), so fan_in_fan_out
T5_TYPES = ("t5", "mt5", "umt5", "longt5")
LLAMA_STYLE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def is_lora(model) -> bool:
    """A model peft's LoRA layers were put into (peft leaves its config on the model)."""
    from train.core.model import unwrapped

    return hasattr(unwrapped(model), "peft_config")


def _has(model, name: str) -> bool:
    return any(n == name or n.endswith("." + name) for n, _ in model.named_modules())


def default_targets(model) -> tuple[list[str] | str, str]:
    """(targets, why) for LORA_TARGETS left empty, by architecture."""
    config = model.config
    if config.model_type == "gpt2":
        return list(GPT2), "GPT-2's attention and MLP layers"
    if config.model_type in T5_TYPES:
        gated = bool(getattr(config, "is_gated_act", False))
        ff = ["wi_0", "wi_1", "wo"] if gated else ["wi", "wo"]
        return ["q", "k", "v", "o", *ff], f"T5's attention and {'gated ' if gated else ''}feed-forward layers"
    present = [name for name in LLAMA_STYLE if _has(model, name)]
    if {"q_proj", "v_proj"} <= set(present):
        return present, f"{config.model_type}'s attention and MLP projections (Llama/Qwen-style names)"
    return "all-linear", (f"{config.model_type}: no known layer names, so every linear layer but the output "
                          f"head")


def parse_targets(text: str | None, model) -> tuple[list[str] | str, str]:
    """LORA_TARGETS as peft takes it; a name that matches no layer is one line naming the variable."""
    if text is None or not text.strip():
        return default_targets(model)
    if text.strip() == "all-linear":
        return "all-linear", ("LORA_TARGETS=all-linear: every linear layer but the output head (peft's "
                              "shortcut)")
    names = [t.strip() for t in text.split(",") if t.strip()]
    defaults = f"(its defaults: {','.join(t) if isinstance(t := default_targets(model)[0], list) else t})"
    head = model.get_output_embeddings()
    for name in names:
        if not _has(model, name):
            raise UsageError(f"LORA_TARGETS={text}: {name!r} names no layer of this "
                             f"{model.config.model_type} model {defaults}")
        for module in _named(model, name):
            # peft's embedding adapter failed at the save after training ('Embedding' object has no
            # attribute 'num_embeddings'); the head is tied to the frozen embeddings ("does not require grad")
            what = "the token embeddings" if isinstance(module, torch.nn.Embedding) else \
                "the output head (tied to the embeddings)" if module is head else None
            if what:
                raise UsageError(f"LORA_TARGETS={text}: {name!r} is {what}; LoRA here adapts the attention "
                                 f"and MLP layers {defaults}")  # fmt: skip
    return names, "LORA_TARGETS"


def _named(model, name: str) -> list:
    return [m for n, m in model.named_modules() if n == name or n.endswith("." + name)]


def _layers(model, chosen) -> list:
    """The Linear / Conv1D layers LoRA adapts for targets `chosen` (parse_targets'), head excluded."""
    from transformers.pytorch_utils import Conv1D

    kinds = (torch.nn.Linear, Conv1D)
    if chosen == "all-linear":
        head = model.get_output_embeddings()
        return [m for m in model.modules() if isinstance(m, kinds) and m is not head]
    return [m for name in chosen for m in _named(model, name) if isinstance(m, kinds)]


def check_rank(model, r: int, chosen) -> None:
    """LORA_R above the rank of every adapted layer: adapters bigger than the layers they adapt
    (LORA_R=100000 went on to an out-of-memory traceback). Low rank is the point: 8 to 64."""
    ranks = [min(m.weight.shape) for m in _layers(model, chosen)]
    if ranks and r > max(ranks):
        raise UsageError(f"LORA_R={r}: above the rank of every adapted layer (at most {max(ranks)} here), so "
                         f"each adapter would be bigger than its layer; LoRA's rank is low: 8 to 64, at most "
                         f"{max(ranks)}")


def adapter_count(model, r: int, targets: str | None) -> tuple[Trainable, int]:
    """(what LoRA at rank r on LORA_TARGETS trains, how many layers it adapts), checked as wrap
    checks them, counted on any model (the meta device's: nothing allocated): A is r x in and B
    out x r, so r x (in + out) parameters per layer; Adafactor keeps rows + columns of each."""
    chosen, _ = parse_targets(targets, model)
    check_rank(model, r, chosen)
    layers = _layers(model, chosen)
    shapes = [sum(m.weight.shape) for m in layers]
    return Trainable(sum(r * n for n in shapes), sum(2 * r + n for n in shapes)), len(layers)


def wrap(model, r: int | None, alpha: float | None, dropout: float | None, targets: str | None, decide,
         sharding: str = "none"):
    """The model with LoRA adapters on `targets`, everything else frozen (r empty or 0: the model
    as it is). Call after the model is loaded and resized, before the optimizer and DDP."""
    # 0: LoRA turned off on purpose, its other settings kept; empty: they were never meant for this run
    if not r:
        stray = (
            []
            if r == 0
            else [
                name
                for name, v in (("LORA_ALPHA", alpha), ("LORA_DROPOUT", dropout), ("LORA_TARGETS", targets))
                if v is not None
            ]
        )
        if stray:  # set for a LoRA run that is not one: the user meant LoRA, or left a variable behind
            raise UsageError(f"{', '.join(stray)} set but LORA_R is empty: set LORA_R (e.g. 16) to train "
                             f"LoRA adapters, or unset them for full fine-tuning")
        return model
    if sharding != "none":  # FSDP2's gathered state and the merge of final/ are not joined up
        raise UsageError(f"LORA_R={r} with SHARDING={sharding}: not built; LoRA's frozen weights need no "
                         f"sharded optimizer state, so use SHARDING=none (DDP with several processes)")
    from peft import LoraConfig, get_peft_model
    from transformers.pytorch_utils import Conv1D

    if not getattr(model, "name_or_path", ""):  # from_config: no folder, random weights
        raise UsageError(f"LORA_R={r}: SFT builds this model new (MODEL_CONFIG / MODEL_SIZE), and LoRA would "
                         f"keep "
                         "its random weights frozen; LoRA adapts a trained model: set MODEL_PATH, or leave "
                         "LORA_R empty")
    if dropout is not None and dropout >= 1:
        raise UsageError(f"LORA_DROPOUT={dropout}: expected a probability below 1 (e.g. 0.05)")
    chosen, why = parse_targets(targets, model)
    check_rank(model, r, chosen)
    alpha = float(2 * r if alpha is None else alpha)
    dropout = DROPOUT if dropout is None else dropout
    config = LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=chosen,
        fan_in_fan_out=any(isinstance(m, Conv1D) for m in model.modules()),
        task_type=family_of(model).peft_task_type,
    )  # fmt: skip
    total = sum(p.numel() for p in model.parameters())
    try:
        with warnings.catch_warnings():  # peft asks the deprecated is_gradient_checkpointing, each run
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
            wrapped = get_peft_model(model, config)
    except ValueError as err:  # a target of a kind peft cannot adapt (a norm, an embedding bag ...)
        raise UsageError(f"LORA_TARGETS={targets or ','.join(chosen)}: {str(err).splitlines()[0]}") from None
    model = wrapped.base_model.model  # the same modules: the run trains the transformers model itself
    adapted = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if hasattr(m, "lora_A")})
    decide(
        "lora_targets",
        ",".join(adapted),
        why + (" (Conv1D: fan_in_fan_out)" if config.fan_in_fan_out else ""),
    )
    decide(
        "lora_alpha",
        alpha,
        f"scale LORA_ALPHA / LORA_R = {alpha / r:g}" + (" (2 x LORA_R)" if alpha == 2 * r else ""),
    )
    decide("lora_dropout", dropout, "LORA_DROPOUT" if dropout != DROPOUT else "the default")
    n = trainable_of(model).params
    decide("trainable_params", n, f"LoRA r={r}: {n:,} of {total:,} parameters trained ({100 * n / total:.2f} "
           f"%); the rest frozen, without gradients or optimizer state")  # fmt: skip
    return model


def saved_state(model) -> dict:
    """What a checkpoint holds of the model: with LoRA the trainable tensors alone (detached),
    else the whole state dict."""
    from train.core.model import unwrapped

    model = unwrapped(model)
    if not is_lora(model):
        return model.state_dict()
    return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}


@torch.no_grad()
def merged_state(model, delta: bool = True) -> dict:
    """The state dict of the merged model (W + scale x B A per adapted layer, peft's own
    get_delta_weight), under the model's own key names, without changing the model: a save in
    the middle of the run (best/) leaves training exactly as it was. delta=False: the frozen
    base as the run trained on it (resized embeddings included), without the adapters."""
    from peft.tuners.lora import LoraLayer

    layers = {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    merged = {}
    for key, tensor in model.state_dict().items():
        if ".lora_" in key:
            continue
        if ".base_layer." not in key:
            merged[key] = tensor
            continue
        prefix, rest = key.split(".base_layer.", 1)
        if delta and rest == "weight" and prefix in layers:
            tensor = tensor + layers[prefix].get_delta_weight(ADAPTER).to(tensor.dtype)
        merged[f"{prefix}.{rest}"] = tensor
    return merged


def _resized(model, base: str | None) -> bool:
    """Whether the embeddings have other rows than MODEL_PATH's config.json says (the kit's chat
    markers): then the adapter must carry them. Read here, never asked of the Hub as peft's "auto"
    would where the folder is gone; unknown counts as resized (the rows saved: bigger, still right)."""
    try:  # no base folder (a model SFT built new): nothing to compare with
        vocab = json.loads((Path(base) / "config.json").read_text()).get("vocab_size") if base else None
    except (OSError, ValueError, AttributeError):
        vocab = None
    return vocab != model.get_input_embeddings().num_embeddings


def save_adapter(model, folder: Path, final: Path | None = None) -> None:
    """peft's adapter files (PeftModel.save_pretrained's): adapter_config.json and
    adapter_model.safetensors, with the embedding rows where the kit resized the vocabulary. Then
    the base the adapter applies to is not MODEL_PATH (8192 rows against the adapter's 8256): the
    resized base is saved in folder/base and named in adapter_config.json, so peft's own
    auto-loader (AutoPeftModelForCausalLM on final/adapter) loads it. final: where folder will be
    once its parent is renamed into place (the path written there)."""
    import safetensors.torch
    from peft.utils import get_peft_model_state_dict

    config = copy.copy(model.peft_config[ADAPTER])
    base = config.base_model_name_or_path
    resized = _resized(model, base)
    state = get_peft_model_state_dict(model, adapter_name=ADAPTER, save_embedding_layers=resized)
    # peft's names are those of its wrapper (base_model.model.<the model's own>); tied rows: a copy each
    tensors = {f"base_model.model.{k}": v.detach().to("cpu").clone().contiguous() for k, v in state.items()}
    folder.mkdir()
    safetensors.torch.save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    config.inference_mode = True  # as peft saves it: loads for generation unless is_trainable=True
    if resized:
        model.save_pretrained(folder / BASE_FOLDER, state_dict=merged_state(model, delta=False))
        config.base_model_name_or_path = str(Path(final or folder).absolute() / BASE_FOLDER)
    # found from anywhere (AutoPeftModel), not only from where the run started
    elif base and Path(base).is_dir():
        config.base_model_name_or_path = str(Path(base).resolve())
    config.save_pretrained(str(folder))


def save_merged(model, folder: Path, final: Path | None = None) -> None:
    """final/ (or best/) of a LoRA run: the merged model, and the adapter in folder/adapter. final:
    the folder's name once renamed into place."""
    model.save_pretrained(folder, state_dict=merged_state(model))
    save_adapter(model, folder / ADAPTER_FOLDER, final and final / ADAPTER_FOLDER)
