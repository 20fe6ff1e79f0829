"""A model config checked before anything is built: a type transformers does not know, a kind the
kit cannot train, a shape that cannot be built or trained. One line each (UsageError), never a
traceback from deep in transformers or a failure after training."""

from __future__ import annotations

import math

from train.core.errors import UsageError
from train.models.family import family_of


def refuse_other_kinds(cfg, variable: str) -> None:
    """A model type this kit cannot train: one line naming what it trains, never transformers'
    list of every config class."""
    if family_of(cfg) is None:
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
