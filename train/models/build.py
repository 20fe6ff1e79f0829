"""Every new model: its config (MODEL_SIZE in MODEL_FAMILY's size table, or MODEL_CONFIG's
config.json), its special ids from the tokenizer, and the model itself (random init, SEED, sdpa
attention where the architecture has it; on the meta device for a dry run). Pretraining and SFT
from scratch both build here; nothing is downloaded."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from train.core.errors import UsageError
from train.core.model import enable_checkpointing
from train.core.remote_code import refuse_custom_code
from train.models import FAMILIES
from train.models.checks import check_raw, check_shape, load_json, refuse_other_kinds, refuse_unknown_type
from train.models.family import Family, family_of, set_dropout


def build_config(
    model_size: str,
    model_config: str | None,
    vocab_size: int,
    eos_id: int,
    model_family: str = "gpt2",
    dropout: float | None = None,
):
    """MODEL_CONFIG's config (vocab and special ids replaced by the tokenizer's), else MODEL_SIZE's
    shape in MODEL_FAMILY's table. dropout (DROPOUT) in every dropout setting of it; None: 0 for
    MODEL_SIZE's (transformers' own 0.1 for GPT-2 and T5 cost nanoGPT's +11 % tokens/s on an H200),
    MODEL_CONFIG's own."""
    if model_config is None:
        cfg = FAMILIES[model_family].config_for(model_size, vocab_size, eos_id)
        set_dropout(cfg, 0.0 if dropout is None else dropout)
        return cfg
    from transformers import AutoConfig

    path = Path(model_config)
    # No TRUST_REMOTE_CODE for a new model: a config naming its own classes is refused.
    refuse_custom_code(path, "MODEL_CONFIG")
    try:
        raw = load_json(config_file_of(model_config).read_text())
        model_type = raw.pop("model_type")
        refuse_unknown_type(model_type, f"MODEL_CONFIG={model_config}")
        # ids within its own vocabulary, before the tokenizer's
        check_raw(raw, f"MODEL_CONFIG={model_config}")
        raw.update(vocab_size=vocab_size, bos_token_id=eos_id, eos_token_id=eos_id)
        cfg = AutoConfig.for_model(model_type, **raw)
    except UsageError:
        raise
    except Exception as err:  # OSError, ValueError, KeyError, huggingface_hub's validation errors
        why = " ".join(line.strip() for line in str(err).splitlines()) or type(err).__name__
        raise UsageError(f"MODEL_CONFIG: {model_config} is not a transformers config.json ({why})") from None
    refuse_other_kinds(cfg, f"MODEL_CONFIG={model_config}")
    set_special_tokens(cfg, eos_id, None)
    if not family_of(cfg).layout.encoder_decoder and not -vocab_size <= (cfg.pad_token_id or 0) < vocab_size:
        # Past the tokenizer's vocabulary, torch's Embedding refuses it as a padding index: pretraining
        # pads nothing, and SFT sets the tokenizer's pad (size_vocab says so).
        cfg.pad_token_id = None
    check_shape(cfg, f"MODEL_CONFIG={model_config}")
    cfg.use_cache = False
    if dropout is not None:
        set_dropout(cfg, dropout)
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
        raw = load_json(config_file_of(model_config).read_text())
    except (OSError, ValueError):
        return {}
    ids = {k: raw.get(k) for k in SPECIAL_IDS if isinstance(raw, dict)}
    return {k: v for k, v in ids.items() if isinstance(v, int) and not isinstance(v, bool)}


def set_special_tokens(cfg, eos_id: int, pad_id: int | None) -> None:
    """The tokenizer's end-of-text (and pad) in the model's config. An encoder-decoder's decoder
    starts from pad, as T5's does; a tokenizer without pad uses end-of-text."""
    cfg.eos_token_id = eos_id
    if family_of(cfg).layout.encoder_decoder:
        cfg.pad_token_id = cfg.decoder_start_token_id = eos_id if pad_id is None else pad_id
    else:
        cfg.bos_token_id = eos_id


def context_length(cfg) -> int:
    """The model's context: its position table's size; else its family's (T5's relative positions
    have no limit: T5's own 512); else 1024."""
    for name in ("n_positions", "max_position_embeddings", "seq_length"):
        if getattr(cfg, name, None):
            return int(getattr(cfg, name))
    family = family_of(cfg)
    return family.context if family else 1024


def build_model(cfg, gradient_checkpointing: bool, seed: int, meta: bool = False):
    """A freshly initialised model from the config, sdpa attention (flash/memory-efficient
    kernels where the device has them; the family's own where it has one, Family.attention); meta:
    shapes and parameter count only (a dry run)."""
    torch.manual_seed(seed)
    family: Family = family_of(cfg)
    auto = family.auto_class()
    with torch.device("meta") if meta else contextlib.nullcontext():
        try:
            model = auto.from_config(cfg, attn_implementation="sdpa", trust_remote_code=False)
        except ValueError:
            model = auto.from_config(cfg, trust_remote_code=False)  # an architecture without sdpa support
    if family.attention is not None:
        family.attention(model)
    if not family.layout.encoder_decoder and getattr(model, "loss_type", None) is None:
        model.loss_type = "ForCausalLM"  # GPT2LMHeadModel's name doesn't say; same loss, no warning
    if gradient_checkpointing:
        enable_checkpointing(model)
    return model


def size_vocab(cfg, tok, decide, variable: str | None = None, declared: dict | None = None) -> None:
    """A new model's vocabulary and special ids from its tokenizer (template markers and T5's
    sentinels included, so the embeddings never need resizing), padded to a multiple of 64.
    declared: MODEL_CONFIG's own ids (declared_ids); where the tokenizer's differ, it is said."""
    from train.core.model import padded_vocab

    cfg.vocab_size = padded_vocab(len(tok))
    if declared is not None:  # a new SFT model: its vocabulary is always a decision
        decide("vocab_size", cfg.vocab_size, f"the tokenizer's {len(tok)} tokens, padded to a multiple of 64")
    elif cfg.vocab_size != len(tok):
        decide("vocab_size", cfg.vocab_size, f"tokenizer's {len(tok)} padded to a multiple of 64")
    set_special_tokens(cfg, tok.convert_tokens_to_ids(tok.eos_token), tok.pad_token_id)
    if declared is None:
        return
    if not family_of(cfg).layout.encoder_decoder:
        cfg.pad_token_id = tok.pad_token_id  # as the collator pads
    now = {k: getattr(cfg, k, None) for k in declared}
    differ = [k for k, v in declared.items() if now[k] != v]
    if differ:
        config = ", ".join(f"{k} {declared[k]}" for k in differ)
        decide("special_ids", {k: now[k] for k in differ}, f"{variable} sets {config}, which the tokenizer "
               "does not have: its ids are used (TOKENIZER_PATH with the config's own tokenizer keeps them)")


def attention_fits(config, kind: str) -> None:
    """Raises what transformers raises where a model of this config cannot take attention `kind`
    (PACKING's varlen kernels), asked of a model on the meta device before the real one exists."""
    from train.core.attention import use_attention

    with torch.device("meta"):
        model = family_of(config).auto_class().from_config(config, trust_remote_code=False)
    use_attention(model, kind)


def new_model(config, gradient_checkpointing: bool, seed: int, meta: bool, device):
    """A new model of a config whose vocabulary the tokenizer has sized (size_vocab), on the
    device; on the meta device for a dry run (shapes and parameter count only)."""
    model = build_model(config, gradient_checkpointing, seed, meta=meta)
    return model if meta else model.to(device)
