"""The t5 family (MODEL_FAMILY=t5): T5's original shape (relu feed-forward, tied embeddings,
relative position buckets) at each MODEL_SIZE: small and medium are t5-small and t5-base. An
encoder-decoder: span corruption on raw text, (source, target) pairs in SFT."""

from __future__ import annotations

from types import MappingProxyType

from train.models.family import ENCODER_DECODER, Family

# n_positions has no meaning for T5's relative positions: CONTEXT is only the default MAX_LENGTH.
CONTEXT = 512
SIZES = MappingProxyType({
    "nano": dict(num_layers=2, num_decoder_layers=2, d_model=256, d_ff=1024, num_heads=4, d_kv=64),
    "tiny": dict(num_layers=4, num_decoder_layers=4, d_model=512, d_ff=2048, num_heads=8, d_kv=64),
    "small": dict(num_layers=6, num_decoder_layers=6, d_model=512, d_ff=2048, num_heads=8, d_kv=64),
    "medium": dict(num_layers=12, num_decoder_layers=12, d_model=768, d_ff=3072, num_heads=12, d_kv=64),
})  # fmt: skip


def make_config(shape, vocab_size: int, eos_id: int):
    from transformers import T5Config

    return T5Config(
        vocab_size=vocab_size,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        decoder_start_token_id=eos_id,
        use_cache=False,
        n_positions=CONTEXT,
        **shape,
    )


def attention(model) -> None:
    """T5_SDPA on the model (train/models/t5_attention.py), imported on use: the launchers read the
    registry without torch."""
    from train.models.t5_attention import install

    install(model)


T5 = Family(
    "t5",
    layout=ENCODER_DECODER,
    auto="AutoModelForSeq2SeqLM",
    peft_task_type="SEQ_2_SEQ_LM",
    sizes=SIZES,
    make_config=make_config,
    context=CONTEXT,
    objective="span_corruption",
    dropout=("dropout_rate",),
    dropout_modules=("dropout",),
    attention=attention,
)
