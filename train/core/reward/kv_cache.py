"""The KV cache that sampling holds, counted two ways: kv_cache_bytes predicts it from a model's config
(the estimate's term for reward training: P*G rows x (prompt + MAX_COMPLETION_LENGTH) positions; a
family's config at a MODEL_SIZE is Family.config_for's), cache_bytes measures a real one (transformers'
DynamicCache, or an encoder-decoder's EncoderDecoderCache), and the tests hold the two equal.

Per layer the cache keeps a key and a value of (rows, key/value heads, positions, head size): Llama's
grouped-query attention keeps num_key_value_heads, GPT-2 and T5 one per attention head. An encoder-
decoder's decoder also keeps each layer's cross-attention keys and values over the source. The dtype is
cache_dtype's: float32 for an fp32 run; under autocast the autocast dtype (bf16, fp16) for GPT-2 and T5,
but float32 for a rotary model (Llama, Qwen3) with float32 weights, the kit's mixed precision: its keys
leave the rotation in float32 (transformers multiplies them by cos/sin of the float32 hidden's dtype), and
DynamicCache's first concatenation promotes the values to the keys' dtype. Measured on CPU (the tests):
the same llama sampling keeps 2x the bytes a bf16 count says; the promotion rules are the device's own.
A sliding-window layer keeps at most its window: counted in full here (an upper bound); the kit's
families have none. What the count leaves out: the prompts' one forward (its activations are freed
before the first token), the logits of one step (rows x vocab, float32), an encoder-decoder's
encoder output copied to every row (rows x source x width), and one layer's cache twice while a step
grows it (DynamicCache concatenates: the old and the new tensor live together), each small beside the
whole cache at length for more than a few layers.
Imports torch only."""

from __future__ import annotations

import torch


def kv_shape(config) -> tuple[int, int, int]:
    """(decoder layers, key/value heads, head size) of a transformers config."""
    layers = getattr(config, "num_decoder_layers", None) or config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return layers, kv_heads, head_dim


def cache_dtype(config, precision: str) -> torch.dtype:
    """The dtype sampling's KV cache is kept in, for a model of float32 weights run at PRECISION
    (fp32, fp16, bf16): float32 where the keys are rotated (the config has rope_parameters or
    rope_theta), else the autocast dtype (module doc)."""
    if precision == "fp32" or getattr(config, "rope_parameters", None) or getattr(config, "rope_theta", None):
        return torch.float32
    return torch.float16 if precision == "fp16" else torch.bfloat16


def kv_cache_bytes(config, rows: int, length: int, dtype: torch.dtype = torch.float32,
                   source_length: int = 0) -> int:  # fmt: skip
    """Bytes of the KV cache of `rows` sequences of `length` cached positions (a causal LM: prompt
    width + completion tokens; an encoder-decoder: completion tokens), plus an encoder-decoder's cross-
    attention cache over `source_length` positions (0 for a causal LM)."""
    layers, kv_heads, head_dim = kv_shape(config)
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * layers * rows * kv_heads * head_dim * (length + source_length) * element


def cache_bytes(cache) -> int:
    """Bytes of a transformers cache's key and value tensors (0 for None)."""
    names = ("self_attention_cache", "cross_attention_cache")  # an encoder-decoder's two
    parts = [getattr(cache, n) for n in names if hasattr(cache, n)]
    total = 0
    for part in parts or [cache]:
        for layer in getattr(part, "layers", ()):
            for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if isinstance(tensor, torch.Tensor):
                    total += tensor.numel() * tensor.element_size()
    return total
