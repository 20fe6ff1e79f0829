"""Every saved model: a local transformers folder (SFT's MODEL_PATH, generate's --model) or a bare
state_dict checkpoint beside its config (state_dict.py, imported in memory), loaded offline with
the Auto class of its family; any other type is refused in one line. Nothing is downloaded, and a
folder's own code runs only when TRUST_REMOTE_CODE allows it."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from types import SimpleNamespace

import torch

from train.core.errors import UsageError
from train.core.model import enable_checkpointing, quiet_saving
from train.core.remote_code import refuse_custom_code
from train.models import state_dict
from train.models.checks import check_raw, check_shape, refuse_other_kinds, refuse_unknown_type
from train.models.family import KINDS, Family, family_of, kind_of_type


def first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def family_of_folder(path: Path, trust_remote_code: bool) -> Family | None:
    """The family of a model folder's config.json (or a bare checkpoint's model_config.json), read
    as JSON (no code runs); a type transformers knows that is neither kind (BERT ...) is refused
    in one line. None where it cannot tell (no readable config, a type of the folder's own code):
    loading then says why."""
    try:
        raw = state_dict.raw_config(state_dict.config_file(Path(path)))
    except (OSError, ValueError, TypeError):
        return None
    if not isinstance(raw, dict):
        return None
    auto_map = raw.get("auto_map") if trust_remote_code else None
    for name, kind in (("AutoModelForSeq2SeqLM", "seq2seq"), ("AutoModelForCausalLM", "causal")):
        if isinstance(auto_map, dict) and name in auto_map:
            return KINDS[kind]
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    config = SimpleNamespace(model_type=raw.get("model_type"), is_decoder=bool(raw.get("is_decoder")),
                             is_encoder_decoder=bool(raw.get("is_encoder_decoder")))
    if config.model_type not in CONFIG_MAPPING_NAMES:
        # not a type of the folder's own code
        if isinstance(config.model_type, str) and "auto_map" not in raw:
            hint = "; if it ships its own model code and you trust it: TRUST_REMOTE_CODE=1"
            refuse_unknown_type(config.model_type, f"MODEL_PATH={path}", "" if trust_remote_code else hint)
        return None
    refuse_other_kinds(config, f"MODEL_PATH={path}")
    kind = kind_of_type(config.model_type, config.is_decoder)
    return family_of(config) if kind else None


def bare_of(path: Path):
    """A bare checkpoint at MODEL_PATH (a state_dict file beside its config, no code), or None."""
    return state_dict.bare_checkpoint(path, "MODEL_PATH")


def read_config(path: Path, trust_remote_code: bool):
    """MODEL_PATH's config, read before any weights (its context decides MAX_LENGTH); one line on
    failure. A bare checkpoint's config is read as JSON, never running code."""
    from transformers import AutoConfig

    bare = bare_of(path)
    if bare:
        return state_dict.read_config(bare.config, "MODEL_PATH")
    allow = ("TRUST_REMOTE_CODE=1 lets it run (or `python -m train import` writes its weights as a plain "
             "folder)")
    refuse_custom_code(path, "MODEL_PATH", trust_remote_code, allow=allow)
    try:
        raw = state_dict.raw_config(Path(path) / "config.json")
    except (OSError, ValueError):
        raw = None  # from_pretrained says what is wrong with it
    if isinstance(raw, dict) and not (trust_remote_code and raw.get("auto_map")):
        check_raw(raw, f"MODEL_PATH={path}")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as err:
        raise UsageError(f"MODEL_PATH={path}: no model config could be read: {first_line(err)}") from None
    if not (trust_remote_code and getattr(config, "auto_map", None)):  # a trusted folder's own classes decide
        # what would fail in the build, or train NaN (MoE, rope ...)
        check_shape(config, f"MODEL_PATH={path}")
    return config


def load_pretrained(path: Path, trust_remote_code: bool, family: Family | None = None):
    """MODEL_PATH's model from local folders only, float32; every failure is one UsageError line.
    family (family_of_folder): its Auto class loads the model (AutoModelForCausalLM when unknown)."""
    bare = bare_of(path)
    if bare:
        return state_dict.load_bare(bare, "MODEL_PATH")[0]
    # No hint about TRUST_REMOTE_CODE when a load fails: a folder that names code of its own was
    # refused (read_config) unless trusted, so the setting cannot be what is missing.
    # float32 weights whatever the checkpoint's dtype (transformers 5 loads "auto"): AdamW on
    # bf16 weights loses small updates; mixed precision is autocast's job (ENABLE_BF16/FP16).
    family = family or KINDS["causal"]
    load = partial(family.auto_class().from_pretrained, path, dtype=torch.float32, local_files_only=True,
                   trust_remote_code=trust_remote_code)
    try:
        with quiet_saving():  # no "Loading weights" bar on every run: the load takes a moment
            try:
                model = load(attn_implementation="sdpa")
            except ValueError as err:
                if "sdpa" not in str(err).lower():
                    raise
                model = load()  # an architecture without sdpa support (T5)
    except Exception as err:
        what = "an encoder-decoder (seq2seq)" if family.layout.encoder_decoder else "a causal-LM"
        raise UsageError(f"MODEL_PATH={path}: not {what} model folder: {first_line(err)}") from None
    state_dict.refuse_non_finite(model.state_dict(), f"MODEL_PATH={path}")  # NaN in, NaN out: refused here
    own = family_of(model)
    if own is not None and own.attention is not None:
        own.attention(model)
    return model


def _decoder_ids(model, tok, decide) -> None:
    """An encoder-decoder's pad and decoder start ids where MODEL_PATH's config.json lacks them:
    the tokenizer's pad (ensure_special_tokens always sets one), and T5's rule, start = pad.
    Unset, the first step would end in a transformers traceback ("... has to be defined")."""
    c = model.config
    if c.pad_token_id is None:
        c.pad_token_id = tok.pad_token_id
        decide("pad_token_id", c.pad_token_id, "MODEL_PATH's config.json has none: the tokenizer's")
    if c.decoder_start_token_id is None:
        c.decoder_start_token_id = model.generation_config.decoder_start_token_id = c.pad_token_id
        decide("decoder_start_token_id", c.pad_token_id, "MODEL_PATH's config.json has none: the pad id, as "
                                                         "T5 starts its decoder")


def fit_tokenizer(model, tok, stop_ids: list[int], decide) -> None:
    """A loaded model made to fit its (chat-ready) tokenizer: embeddings resized for the chat
    template's tokens, generate()'s stop and pad ids (saved with final/: a plain model.generate()
    then stops at the end of the assistant's turn), an encoder-decoder's decoder start."""
    rows = model.get_input_embeddings().num_embeddings
    if len(tok) > rows:
        from transformers.utils import logging as hf_logging

        # transformers explains its mean resizing in a paragraph with a link on every run; the
        # decision below says it once, in the kit's words.
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        try:
            model.resize_token_embeddings(len(tok), pad_to_multiple_of=64)
        finally:
            hf_logging.set_verbosity(verbosity)
        decide(
            "vocab_size",
            model.get_input_embeddings().num_embeddings,
            f"resized embeddings {rows} -> {model.get_input_embeddings().num_embeddings} for "
            f"{len(tok) - rows} token(s) "
            "beyond its vocabulary (TEMPLATE's chat tokens) (a multiple of 64; new rows drawn around the "
            "mean of the old)",
        )
    model.generation_config.eos_token_id = stop_ids
    model.generation_config.pad_token_id = tok.pad_token_id
    family = family_of(model)
    if family.layout.encoder_decoder:
        _decoder_ids(model, tok, decide)
    elif getattr(model, "loss_type", None) is None:
        model.loss_type = "ForCausalLM"  # as pretraining sets it; left unset, transformers warns each run


def ready(model, gradient_checkpointing: bool):
    """Training mode: the KV cache off (it only costs memory in training), checkpointing on if asked."""
    model.config.use_cache = False
    if gradient_checkpointing:
        enable_checkpointing(model)
    model.train()  # from_pretrained returns the model in eval mode (dropout off)
    return model


def load_folder(path: Path, variable: str, trust_remote_code: bool):
    """(model, tokenizer) of a saved model folder for inference (generate): its config read
    offline, the Auto class of its family, the checkpoint's own dtype; one line on failure."""
    from transformers import AutoConfig, AutoTokenizer

    offline = dict(local_files_only=True, trust_remote_code=trust_remote_code)
    try:
        config = AutoConfig.from_pretrained(path, **offline)
        # a trusted model's own classes decide
        trusted = trust_remote_code and getattr(config, "auto_map", None)
        if not trusted:
            refuse_other_kinds(config, variable)
        family = family_of(config) or KINDS["causal"]
        tok = AutoTokenizer.from_pretrained(path, **offline)
        model = family.auto_class().from_pretrained(path, config=config, **offline)
    except UsageError:
        raise
    except Exception as err:  # a folder transformers cannot load: one line, not a traceback
        raise UsageError(f"{variable}: cannot load the model: {first_line(err)}") from None
    return model, tok
