"""SFT from scratch: MODEL_CONFIG (a transformers config.json) or MODEL_SIZE (+ MODEL_FAMILY)
builds a NEW model (random init, SEED) that trains on the SFT data's source -> target pairs, the
way ChatLM-mini-Chinese "pretrains" its T5 on prompt/response parquet: an encoder-decoder through
the seq2seq SFT path (encoder source, decoder target), a causal LM through the causal one.
MODEL_PATH with either is refused: one model, loaded or built.

The tokenizer is TOKENIZER_PATH, or a byte-level BPE (VOCAB_SIZE) trained on the SFT data's own
text (train/data/tokenizer.py turns_tokenizer). The model's special ids come from that tokenizer
(pad, eos; an encoder-decoder's decoder starts at pad, as T5's does). Where MODEL_CONFIG sets its
own (ChatLM's pad 0, eos 1), a trained BPE is laid out to give the same ids; where they still
differ, the decision says so (train/models/build.py size_vocab).
"""

from __future__ import annotations

from types import MappingProxyType

from config import TrainConfig
from train.core.errors import UsageError
from train.models.build import build_config, context_length, declared_ids
from train.models.family import family_of
from train.run.plan.make import ModelChoice, note_family_ignored


def asked(cfg: TrainConfig) -> bool:
    """MODEL_CONFIG or MODEL_SIZE set: SFT builds a new model."""
    return cfg.model.model_config is not None or cfg.model.model_size is not None


def refuse_both(cfg: TrainConfig) -> None:
    if cfg.model.model_path is not None and asked(cfg):
        both = "MODEL_CONFIG" if cfg.model.model_config is not None else "MODEL_SIZE"
        raise UsageError(
            f"MODEL_PATH and {both} are both set: MODEL_PATH fine-tunes an existing model, {both} builds a "
            f"new one; set one of them"
        )
    # said before the tokenizer trains, not after (models/lora.py's own check)
    if asked(cfg) and cfg.model.lora_r:
        raise UsageError(f"LORA_R={cfg.model.lora_r}: SFT builds this model new (MODEL_CONFIG / MODEL_SIZE), "
                         f"and LoRA "
                         "would keep its random weights frozen; LoRA adapts a trained model: set MODEL_PATH, "
                         "or leave LORA_R empty")


def choose_new(cfg: TrainConfig, say, decide) -> ModelChoice:
    """The new model's config (from MODEL_CONFIG / MODEL_SIZE): its vocabulary waits for the tokenizer."""
    m = cfg.model
    if m.model_config is not None:
        size, variable = "custom", f"MODEL_CONFIG={m.model_config}"
        decide("model_size", "custom", f"MODEL_CONFIG={m.model_config}: a new model, trained from scratch")
        note_family_ignored(cfg, say, "MODEL_CONFIG's model_type decides the model")
    else:
        size, variable = m.model_size, f"MODEL_SIZE={m.model_size}"
    config = build_config(size, m.model_config, cfg.data.vocab_size, 0, m.model_family, m.dropout)
    family = family_of(config)
    what = family.layout.pick("a causal LM: conversations", "an encoder-decoder: source -> target")
    decide("model", f"new {config.model_type}", f"{variable}: random init (SEED={cfg.system.seed}), {what}; "
                                                f"no MODEL_PATH")
    refuse_packing(cfg, family.layout, variable)
    return ModelChoice(
        family=family,
        size=size,
        context=context_length(config),
        variable=variable,
        config=config,
        declared=MappingProxyType(declared_ids(m.model_config)),
    )


def refuse_packing(cfg: TrainConfig, layout, what: str) -> None:
    """PACKING=1 with an encoder-decoder: before the weights or any data are read."""
    layout.refuse_packing(
        cfg.data.packing,
        f"PACKING=1: {what} is an encoder-decoder, and packing several source -> target pairs per row "
        "(per-pair attention masks on both sides) is not built; use LENGTH_GROUPING=1 or TOKEN_BUDGET",
    )
