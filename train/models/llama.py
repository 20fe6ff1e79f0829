"""The llama block's families. llama (MODEL_FAMILY=llama): transformers' LlamaForCausalLM, the shape of
MiniMind2 and SmolLM2: RMSNorm, rotary positions, a SwiGLU feed-forward (intermediate ~8/3 of the width, a
multiple of 64) and grouped-query attention (half as many key/value heads as query heads), no biases,
embeddings tied as MiniMind2's and SmolLM2's small models do. At an 8K vocab: nano 5.0M, tiny 27.8M, small
81.8M, medium 291.6M (about 335M at a 50K vocab).

qwen3 (MODEL_FAMILY=qwen3): transformers' Qwen3ForCausalLM, the same block with an RMSNorm on each head's
queries and keys before the rotation (q_norm, k_norm: the block MiniMind's current model uses), at the same
sizes and settings (2 x 64 weights a layer more: the counts above round the same); saved as a plain Qwen3
folder (model_type qwen3). It is an entry here, not a file of its own: train/models holds at most 15 modules
(tests/test_architecture.py)."""

from __future__ import annotations

from types import MappingProxyType

from train.models.family import CAUSAL_LM, Family

SIZES = MappingProxyType({
    "nano": dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=704, max_position_embeddings=256),
    "tiny": dict(num_hidden_layers=8, hidden_size=512, num_attention_heads=8, num_key_value_heads=4,
                 intermediate_size=1408, max_position_embeddings=1024),
    "small": dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12, num_key_value_heads=4,
                  intermediate_size=2048, max_position_embeddings=1024),
    "medium": dict(num_hidden_layers=24, hidden_size=1024, num_attention_heads=16, num_key_value_heads=8,
                   intermediate_size=2816, max_position_embeddings=1024),
})  # fmt: skip


def make_config(shape, vocab_size: int, eos_id: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, bos_token_id=eos_id, eos_token_id=eos_id, use_cache=False,
                       tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=10000.0, hidden_act="silu",
                       attention_bias=False, mlp_bias=False, **shape)


def make_qwen3_config(shape, vocab_size: int, eos_id: int):
    from transformers import Qwen3Config

    # Qwen3Config's defaults are Qwen3-8B's (head size 128, rope_theta 1e6, RMSNorm eps 1e-6, a sliding
    # window setting): each is set to llama's, so that the two families differ by the q/k norms alone.
    return Qwen3Config(vocab_size=vocab_size, bos_token_id=eos_id, eos_token_id=eos_id, use_cache=False,
                       tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=10000.0, hidden_act="silu",
                       attention_bias=False, use_sliding_window=False, sliding_window=None,
                       head_dim=shape["hidden_size"] // shape["num_attention_heads"], **shape)


LLAMA = Family(
    "llama",
    layout=CAUSAL_LM,
    auto="AutoModelForCausalLM",
    peft_task_type="CAUSAL_LM",
    sizes=SIZES,
    make_config=make_config,
    dropout=("attention_dropout",),
    dropout_modules=("attention_dropout",),
)
QWEN3 = Family(
    "qwen3",
    layout=CAUSAL_LM,
    auto="AutoModelForCausalLM",
    peft_task_type="CAUSAL_LM",
    sizes=SIZES,
    make_config=make_qwen3_config,
    dropout=("attention_dropout",),
    dropout_modules=("attention_dropout",),
    qk_norm=True,
)
