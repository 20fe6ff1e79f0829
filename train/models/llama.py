"""The llama family (MODEL_FAMILY=llama): transformers' LlamaForCausalLM, the shape of MiniMind2 and
SmolLM2 (MiniMind's current model adds q/k norms: Qwen3's block, not built here): RMSNorm, rotary
positions, a SwiGLU feed-forward (intermediate ~8/3 of the width, a multiple of 64) and grouped-query
attention (half as many key/value heads as query heads), no biases, embeddings tied as MiniMind2's and
SmolLM2's small models do. At an 8K
vocab: nano 5.0M, tiny 27.8M, small 81.8M, medium 291.6M (about 335M at a 50K vocab)."""

from __future__ import annotations

from types import MappingProxyType

from train.models.family import Family

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


LLAMA = Family("llama", source_target=False, auto="AutoModelForCausalLM", peft_task_type="CAUSAL_LM", sizes=SIZES,
               make_config=make_config, dropout=("attention_dropout",), dropout_modules=("attention_dropout",))
