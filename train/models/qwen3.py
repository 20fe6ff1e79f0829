"""The qwen3 family (MODEL_FAMILY=qwen3): transformers' Qwen3ForCausalLM, the llama block with an
RMSNorm on each head's queries and keys before the rotation (q_norm, k_norm: Qwen3's block, the one
MiniMind's current model uses). Everything else is llama.py's: its size table, head size 64,
grouped-query attention, SwiGLU, no biases, tied embeddings, rope_theta 10000 and RMSNorm eps 1e-5,
so that MODEL_FAMILY=llama and qwen3 differ only by the norms (2 x 64 weights a layer). At an 8K
vocab: nano 5.0M, tiny 27.8M, small 81.8M, medium 291.6M, as llama's. Saved as a plain Qwen3 folder
(model_type qwen3), which AutoModelForCausalLM loads."""

from __future__ import annotations

from train.models.family import Family
from train.models.llama import SIZES


def make_config(shape, vocab_size: int, eos_id: int):
    from transformers import Qwen3Config

    # Qwen3Config's defaults are Qwen3-8B's (head size 128, rope_theta 1e6, 4096-token sliding
    # window setting): each is set to llama's so the two families' sizes are the same models.
    return Qwen3Config(vocab_size=vocab_size, bos_token_id=eos_id, eos_token_id=eos_id, use_cache=False,
                       tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=10000.0, hidden_act="silu",
                       attention_bias=False, use_sliding_window=False, sliding_window=None,
                       head_dim=shape["hidden_size"] // shape["num_attention_heads"], **shape)


QWEN3 = Family("qwen3", source_target=False, auto="AutoModelForCausalLM", peft_task_type="CAUSAL_LM", sizes=SIZES,
               make_config=make_config, dropout=("attention_dropout",), dropout_modules=("attention_dropout",),
               qk_norm=True)
