"""The gpt2 family (MODEL_FAMILY=gpt2, the default): GPT2LMHeadModel, learned positions, tied
embeddings. nano is the CPU/test size; tiny ~30M with an 8K vocab (~50M with GPT-2's 50K); small
and medium are GPT-2 small (124M) and medium (350M)."""

from __future__ import annotations

from types import MappingProxyType

from train.models.family import CAUSAL_LM, Family

SIZES = MappingProxyType({
    "nano": dict(n_layer=4, n_embd=256, n_head=4, n_positions=256),
    "tiny": dict(n_layer=8, n_embd=512, n_head=8, n_positions=1024),
    "small": dict(n_layer=12, n_embd=768, n_head=12, n_positions=1024),
    "medium": dict(n_layer=24, n_embd=1024, n_head=16, n_positions=1024),
})  # fmt: skip


def make_config(shape, vocab_size: int, eos_id: int):
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=vocab_size, bos_token_id=eos_id, eos_token_id=eos_id, use_cache=False, **shape
    )


GPT2 = Family(
    "gpt2",
    layout=CAUSAL_LM,
    auto="AutoModelForCausalLM",
    peft_task_type="CAUSAL_LM",
    sizes=SIZES,
    make_config=make_config,
    dropout=("resid_pdrop", "embd_pdrop", "attn_pdrop"),
    dropout_modules=(),
)
