"""The model: a transformers causal LM or encoder-decoder (T5, BART ...) built from a config
(never downloaded), sdpa attention where the architecture has it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from train.core.errors import UsageError
from train.core.remote_code import refuse_custom_code

# GPT-2 family shapes. nano is the CPU/test size; tiny ~30M with an 8K vocab (~50M with GPT-2's
# 50K); small and medium are GPT-2 small (124M) and medium (350M).
SIZES = {
    "nano": dict(n_layer=4, n_embd=256, n_head=4, n_positions=256),
    "tiny": dict(n_layer=8, n_embd=512, n_head=8, n_positions=1024),
    "small": dict(n_layer=12, n_embd=768, n_head=12, n_positions=1024),
    "medium": dict(n_layer=24, n_embd=1024, n_head=16, n_positions=1024),
}


# T5's original shape (relu feed-forward, tied embeddings) at each MODEL_SIZE with MODEL_FAMILY=t5:
# small and medium are t5-small and t5-base; n_positions is only the default MAX_LENGTH (T5's
# relative position buckets have no hard limit).
T5_SIZES = {
    "nano": dict(num_layers=2, num_decoder_layers=2, d_model=256, d_ff=1024, num_heads=4, d_kv=64),
    "tiny": dict(num_layers=4, num_decoder_layers=4, d_model=512, d_ff=2048, num_heads=8, d_kv=64),
    "small": dict(num_layers=6, num_decoder_layers=6, d_model=512, d_ff=2048, num_heads=8, d_kv=64),
    "medium": dict(num_layers=12, num_decoder_layers=12, d_model=768, d_ff=3072, num_heads=12, d_kv=64),
}
T5_CONTEXT = 512


def model_kind(cfg) -> str | None:
    """"causal" (GPT-2, Llama, Qwen ...), "seq2seq" (T5, mT5, BART ...) or None for a model type
    that is neither (BERT, ViT ...), from transformers' own tables of model types."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
    )

    model_type = getattr(cfg, "model_type", None)
    if model_type in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:
        return "seq2seq"
    # BERT, RoBERTa ... are in the causal table too (a head for is_decoder=True), but are encoders.
    encoder = model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(cfg, "is_decoder", False)
    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not encoder:
        return "causal"
    return None


def refuse_other_kinds(cfg, variable: str) -> None:
    """A model type this kit cannot train: one line naming what it trains, never transformers'
    list of every config class."""
    if model_kind(cfg) is None:
        raise UsageError(
            f"{variable}: model type {getattr(cfg, 'model_type', None)!r} is neither a causal LM (gpt2, llama, "
            "qwen2, mistral ...) nor an encoder-decoder LM (t5, mt5, bart ...); this kit trains those two kinds"
        )


def refuse_unknown_type(model_type, variable: str, hint: str = "") -> None:
    """A model_type transformers does not know: one short line, not transformers' own error,
    which lists every model type it has (11,745 characters on one line)."""
    from transformers import CONFIG_MAPPING

    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise UsageError(
            f"{variable}: unknown model_type {str(model_type)[:80]!r}; this kit trains causal LMs (gpt2, llama, "
            f"qwen2 ...) and encoder-decoders (t5, bart ...){hint}"
        )


def unwrapped(model):
    """The transformers model inside DDP (.module) or torch.compile (._orig_mod); FSDP2 keeps
    the model's own class."""
    for attr in ("module", "_orig_mod"):
        model = getattr(model, attr, model)
    return model


def is_seq2seq(model_or_config) -> bool:
    """An encoder-decoder model (or its config), wrapped or not."""
    cfg = getattr(unwrapped(model_or_config), "config", model_or_config)
    return bool(getattr(cfg, "is_encoder_decoder", False))


def set_special_tokens(cfg, eos_id: int, pad_id: int | None) -> None:
    """The tokenizer's end-of-text (and pad) in the model's config. An encoder-decoder's decoder
    starts from pad, as T5's does; a tokenizer without pad uses end-of-text."""
    cfg.eos_token_id = eos_id
    if is_seq2seq(cfg):
        cfg.pad_token_id = cfg.decoder_start_token_id = eos_id if pad_id is None else pad_id
    else:
        cfg.bos_token_id = eos_id


def padded_vocab(n: int, multiple: int = 64) -> int:
    """Round the vocabulary up to a multiple of 64: tensor-core friendly matmul shapes
    (nanoGPT's 50257 -> 50304 gave ~25 % on the LM head)."""
    return (n + multiple - 1) // multiple * multiple


def build_config(model_size: str, model_config: str | None, vocab_size: int, eos_id: int, model_family: str = "gpt2"):
    from transformers import AutoConfig, GPT2Config, T5Config

    if model_config is None and model_family == "t5":
        return T5Config(
            vocab_size=vocab_size,
            eos_token_id=eos_id,
            pad_token_id=eos_id,
            decoder_start_token_id=eos_id,
            use_cache=False,
            n_positions=T5_CONTEXT,
            **T5_SIZES[model_size],
        )
    if model_config is None:
        return GPT2Config(
            vocab_size=vocab_size,
            bos_token_id=eos_id,
            eos_token_id=eos_id,
            use_cache=False,
            **SIZES[model_size],
        )
    path = Path(model_config)
    # No TRUST_REMOTE_CODE for a new model: a config naming its own classes is refused.
    refuse_custom_code(path, "MODEL_CONFIG")
    try:
        raw = json.loads(config_file_of(model_config).read_text())
        model_type = raw.pop("model_type")
        refuse_unknown_type(model_type, f"MODEL_CONFIG={model_config}")
        raw.update(vocab_size=vocab_size, bos_token_id=eos_id, eos_token_id=eos_id)
        cfg = AutoConfig.for_model(model_type, **raw)
    except UsageError:
        raise
    except Exception as err:  # OSError, ValueError, KeyError, huggingface_hub's validation errors
        why = " ".join(line.strip() for line in str(err).splitlines()) or type(err).__name__
        raise UsageError(f"MODEL_CONFIG: {model_config} is not a transformers config.json ({why})") from None
    refuse_other_kinds(cfg, f"MODEL_CONFIG={model_config}")
    set_special_tokens(cfg, eos_id, None)
    check_shape(cfg, f"MODEL_CONFIG={model_config}")
    cfg.use_cache = False
    return cfg


def config_file_of(model_config: str) -> Path:
    """MODEL_CONFIG's file: the path itself, or config.json in a folder."""
    path = Path(model_config)
    return path / "config.json" if path.is_dir() else path


SPECIAL_IDS = ("pad_token_id", "eos_token_id", "decoder_start_token_id")


def declared_ids(model_config: str | None) -> dict:
    """The special ids MODEL_CONFIG's own file sets ({} for none, or an unreadable file, which
    build_config reports): build_config replaces them with the tokenizer's, so SFT reads them
    first to lay out a trained tokenizer the same way or say where they differ."""
    if model_config is None:
        return {}
    try:
        raw = json.loads(config_file_of(model_config).read_text())
    except (OSError, ValueError):
        return {}
    ids = {k: raw.get(k) for k in SPECIAL_IDS if isinstance(raw, dict)}
    return {k: v for k, v in ids.items() if isinstance(v, int) and not isinstance(v, bool)}


def check_shape(cfg, variable: str) -> None:
    """A model that cannot be built or trained (no layers, a width the heads do not divide)
    stops here in one line, not in a traceback from deep in transformers, or after training."""

    def whole(name: str, value) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"{variable}: {name} must be a whole number >= 1, got {value!r}")
        return value

    try:
        layers, hidden, heads = cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads
    except AttributeError as err:
        raise UsageError(f"{variable}: not a decoder config this kit can train ({err})") from None
    whole("the number of layers (n_layer / num_hidden_layers)", layers)
    whole("the width (n_embd / hidden_size)", hidden)
    whole("the number of heads (n_head / num_attention_heads)", heads)
    if getattr(cfg, "head_dim", None) is None and getattr(cfg, "d_kv", None) is None and hidden % heads:
        raise UsageError(f"{variable}: the width {hidden} (n_embd / hidden_size) is not divisible by the {heads} heads")
    kv = getattr(cfg, "num_key_value_heads", None)
    if kv is not None and heads % whole("num_key_value_heads", kv):
        raise UsageError(f"{variable}: {heads} attention heads are not divisible by num_key_value_heads {kv}")
    for name in ("n_positions", "max_position_embeddings", "seq_length"):
        if getattr(cfg, name, None) is not None:
            whole(f"the context length ({name})", getattr(cfg, name))
            break
    # Sizes transformers divides by or builds layers of: 0 is a ZeroDivisionError in the weight
    # init (T5's d_kv, d_ff) or at the first forward (T5's relative position buckets).
    for name in SIZE_FIELDS:
        if getattr(cfg, name, None) is not None:
            whole(name, getattr(cfg, name))
    check_buckets(cfg, variable)
    check_finite(cfg.to_dict(), variable)


SIZE_FIELDS = ("d_kv", "d_ff", "n_inner", "intermediate_size", "head_dim",
               "num_decoder_layers", "relative_attention_max_distance")  # fmt: skip


def check_buckets(cfg, variable: str) -> None:
    """T5's relative positions: the encoder halves the buckets and takes half of those as exact
    offsets, then divides by log(max_distance / exact); fewer than 4 buckets, or a distance not
    beyond the decoder's exact half, divides by zero or indexes outside the table."""
    buckets = getattr(cfg, "relative_attention_num_buckets", None)
    distance = getattr(cfg, "relative_attention_max_distance", None)
    if buckets is None:
        return
    if isinstance(buckets, bool) or not isinstance(buckets, int) or buckets < 4:
        raise UsageError(f"{variable}: relative_attention_num_buckets must be a whole number >= 4, got {buckets!r}")
    if distance is not None and distance <= buckets // 2:
        raise UsageError(
            f"{variable}: relative_attention_max_distance ({distance}) must be larger than half of "
            f"relative_attention_num_buckets ({buckets})"
        )


def check_finite(values: dict, variable: str, prefix: str = "") -> None:
    """Every float of a model config finite: a NaN layer_norm_epsilon trains NaN from the first
    step and would end advising a lower LEARNING_RATE."""
    for key, value in values.items():
        if isinstance(value, dict):
            check_finite(value, variable, f"{prefix}{key}.")
        elif isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"{variable}: {prefix}{key} is {value}; a model config's numbers must be finite")


def context_length(cfg) -> int:
    """The model's context: its position table's size; an encoder-decoder without one (T5's
    relative positions have no limit) T5's own 512; else 1024."""
    for name in ("n_positions", "max_position_embeddings", "seq_length"):
        if getattr(cfg, name, None):
            return int(getattr(cfg, name))
    return T5_CONTEXT if is_seq2seq(cfg) else 1024


def shape(cfg) -> dict:
    """Layers, heads and head size for the FLOPs count (6N + 12·L·H·Q·T)."""
    n_layer = cfg.num_hidden_layers
    n_head = cfg.num_attention_heads
    return {"n_layer": n_layer, "n_head": n_head, "head_dim": cfg.hidden_size // n_head}


def auto_class(cfg):
    """transformers' Auto class that builds and loads this config's model."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    return AutoModelForSeq2SeqLM if is_seq2seq(cfg) else AutoModelForCausalLM


def build_model(cfg, gradient_checkpointing: bool, seed: int):
    """A freshly initialised model from the config, sdpa attention (flash/memory-efficient
    kernels where the device has them)."""
    torch.manual_seed(seed)
    auto = auto_class(cfg)
    try:
        model = auto.from_config(cfg, attn_implementation="sdpa", trust_remote_code=False)
    except ValueError:
        model = auto.from_config(cfg, trust_remote_code=False)  # an architecture without sdpa support
    if not is_seq2seq(cfg) and getattr(model, "loss_type", None) is None:
        model.loss_type = "ForCausalLM"  # GPT2LMHeadModel's name doesn't say; same loss, no warning
    if gradient_checkpointing:
        enable_checkpointing(model)
    return model


def enable_checkpointing(model) -> None:
    """ENABLE_GRAD_CKPT: recompute each block's activations in the backward pass (non-reentrant,
    the form torch recommends). transformers 5.2x renamed the call; older ones have only the
    old name, which newer ones still accept with a FutureWarning."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def count_params(model) -> int:
    """Unique parameters (tied input/output embeddings counted once, as HF and nanoGPT do)."""
    return sum(p.numel() for p in model.parameters())
