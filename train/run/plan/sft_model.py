"""SFT's model: MODEL_PATH (or the newest completed pretraining run's final/, choose_pretrained)
loaded offline with the Auto class its config.json names: AutoModelForCausalLM for a causal LM (GPT-2, Llama, Qwen ...),
AutoModelForSeq2SeqLM for an encoder-decoder (T5, mT5, BART ...); any other type is refused in
one line. A bare checkpoint (a state_dict file beside config.json or ChatLM's model_config.json,
train/core/state_dict.py) is imported in memory; final/ is then a transformers folder. Then made
ready for chat: template tokens, stop tokens, training mode.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import torch

from config import TrainConfig
from train.core import files, state_dict
from train.core import model as model_lib
from train.core.errors import UsageError
from train.core.remote_code import refuse_custom_code
from train.data.sft.sft_data import ensure_special_tokens, stop_token_ids
from train.run.rundir.rundir import unfinished
from train.run.rundir.runlog import quiet_saving

MAKE_A_MODEL = "MODEL_SIZE=nano MAX_STEPS=200 ./run_single_gpu_optimized.sh"


# Who may have made SFT's default model: the pretraining launchers and `python -m train pretrain`.
# Never doctor-* (doctor.py), compare-* / gpu-report-* (KIT_MADE_BY in scripts/common.sh): their
# runs are a few steps long, measurements rather than models.
PRETRAIN_LAUNCHERS = ("run_single_gpu", "run_single_gpu_optimized", "train")
SFT_FAMILY = "gpt2"  # a chat model is a causal LM: a T5 run is taken only when it is the only one
FEW_STEPS = 50  # fewer optimizer steps: the model still emits noise, and so will its SFT


def _json_of(path: Path) -> dict | None:
    """A kit file read as JSON, never through a link; None when it is not a readable object."""
    try:
        data = json.loads(files.read_text(path))
    except (OSError, ValueError, files.LinkRefused):
        return None  # a half-written or foreign file: not a run to start from
    return data if isinstance(data, dict) else None


def pretrained_run(run: Path) -> SimpleNamespace | None:
    """run's final/ as SFT's default candidate, or None: a folder (not a link) whose summary.json
    says a pretraining run that completed its budget (MAX_STEPS counts; Ctrl-C, out of memory, a
    kill do not), whose final/ is whole and of that step, started by PRETRAIN_LAUNCHERS."""
    summary = _json_of(run / "summary.json") if run.is_dir() and not run.is_symlink() else None
    config = _json_of(run / "config.json") if summary else None
    if not summary or not config or summary.get("mode") != "pretrain" or summary.get("exit_reason") != "completed":
        return None
    steps = summary.get("steps")
    if not isinstance(steps, int) or unfinished(run, steps) is not None:
        return None
    run_cfg = config.get("config", {}).get("run") if isinstance(config.get("config"), dict) else None
    if not isinstance(run_cfg, dict) or run_cfg.get("launcher") not in PRETRAIN_LAUNCHERS:
        return None
    family = (_json_of(run / "final" / "config.json") or {}).get("model_type")  # what was built, not asked
    return SimpleNamespace(final=run / "final", steps=steps, family=family if isinstance(family, str) else "?",
                           time=(run / "summary.json").stat().st_mtime)


def choose_pretrained(output_dir: Path) -> SimpleNamespace | None:
    """The newest completed launcher-made gpt2 pretraining run under output_dir (another family
    only where no gpt2 run is there). runs/latest is no help: it may be an SFT or compare run."""
    found = [c for run in (output_dir.iterdir() if output_dir.is_dir() else ()) if (c := pretrained_run(run))]
    same = [c for c in found if c.family == SFT_FAMILY]
    return max(same or found, key=lambda c: c.time, default=None)


def newest_pretrained(output_dir: Path) -> Path | None:
    """final/ of choose_pretrained's run, or None."""
    chosen = choose_pretrained(output_dir)
    return chosen.final if chosen else None


def model_source(cfg: TrainConfig, decide, say=print) -> str:
    """MODEL_PATH, or choose_pretrained's final/ under OUTPUT_DIR, with a warning where it is
    barely trained."""
    if cfg.model.model_path is not None:
        return cfg.model.model_path
    chosen = choose_pretrained(Path(cfg.run.output_dir))
    if chosen is None:
        raise UsageError(
            f"MODEL_PATH is empty and {cfg.run.output_dir} holds no completed pretraining run of a launcher "
            f"(compare, doctor and unfinished runs do not count); make one with `{MAKE_A_MODEL}` or set MODEL_PATH "
            "to a local transformers model folder"
        )
    why = "the newest completed pretraining run of a launcher (set MODEL_PATH to choose)"
    if chosen.family != SFT_FAMILY:
        why += f"; note: a {chosen.family} model, as no completed {SFT_FAMILY} pretraining run is there"
    decide("model_path", str(chosen.final), why)
    if chosen.steps < FEW_STEPS:
        say(f"warning: MODEL_PATH={chosen.final} trained only {chosen.steps} optimizer steps (under {FEW_STEPS}): "
            f"fine-tuning it teaches little; pretrain longer (`{MAKE_A_MODEL}`) or set MODEL_PATH")
    return str(chosen.final)


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def model_kind_of(path: Path, trust_remote_code: bool) -> str | None:
    """"causal" or "seq2seq" from MODEL_PATH's config.json (or a bare checkpoint's
    model_config.json), read as JSON (no code runs); a type transformers knows that is neither
    (BERT ...) is refused in one line. None where it cannot tell (no readable config, a type of
    the folder's own code): loading then says why."""
    try:
        raw = state_dict.raw_config(state_dict.config_file(Path(path)))
    except (OSError, ValueError, TypeError):
        return None
    if not isinstance(raw, dict):
        return None
    auto_map = raw.get("auto_map") if trust_remote_code else None
    for name, kind in (("AutoModelForSeq2SeqLM", "seq2seq"), ("AutoModelForCausalLM", "causal")):
        if isinstance(auto_map, dict) and name in auto_map:
            return kind
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    config = SimpleNamespace(model_type=raw.get("model_type"), is_decoder=bool(raw.get("is_decoder")))
    if config.model_type not in CONFIG_MAPPING_NAMES:
        if isinstance(config.model_type, str) and "auto_map" not in raw:  # not a type of the folder's own code
            hint = "; if it ships its own model code and you trust it: TRUST_REMOTE_CODE=1"
            model_lib.refuse_unknown_type(config.model_type, f"MODEL_PATH={path}", "" if trust_remote_code else hint)
        return None
    model_lib.refuse_other_kinds(config, f"MODEL_PATH={path}")
    return model_lib.model_kind(config)


def load_pretrained(path: Path, tokenizer_path: str | None, trust_remote_code: bool, kind: str | None = None):
    """(model, tokenizer) from local folders only; every failure is one UsageError line. kind
    (model_kind_of): "seq2seq" loads with AutoModelForSeq2SeqLM, else AutoModelForCausalLM."""
    from transformers import AutoTokenizer

    # No hint about TRUST_REMOTE_CODE when a load fails: a folder that names code of its own was
    # refused above unless trusted, so the setting cannot be what is missing.
    offline = dict(local_files_only=True, trust_remote_code=trust_remote_code)
    tok_source = tokenizer_path or path
    var = "TOKENIZER_PATH" if tokenizer_path else "MODEL_PATH"
    bare = state_dict.bare_checkpoint(path, "MODEL_PATH")  # a state_dict file beside its config, no code
    allow = "TRUST_REMOTE_CODE=1 lets it run (or `python -m train import` writes its weights as a plain folder)"
    for folder, name in ((tok_source, var), *(() if bare else ((path, "MODEL_PATH"),))):
        refuse_custom_code(folder, name, trust_remote_code, allow=allow)
    try:
        tok = AutoTokenizer.from_pretrained(tok_source, **offline)
    except Exception as err:  # transformers raises OSError, ValueError, KeyError... for a bad folder
        also = "; a bare checkpoint's tokenizer is given with TOKENIZER_PATH" if bare and not tokenizer_path else ""
        raise UsageError(f"{var}={tok_source}: no tokenizer could be loaded: {_first_line(err)}{also}") from None
    if bare:
        return state_dict.load_bare(bare, "MODEL_PATH")[0], tok
    # float32 weights whatever the checkpoint's dtype (transformers 5 loads "auto"): AdamW on
    # bf16 weights loses small updates; mixed precision is autocast's job (ENABLE_BF16/FP16).
    auto = model_lib.auto_class(SimpleNamespace(is_encoder_decoder=kind == "seq2seq"))
    load = partial(auto.from_pretrained, path, dtype=torch.float32, **offline)
    try:
        with quiet_saving():  # no "Loading weights" bar on every run: the load takes a moment
            try:
                model = load(attn_implementation="sdpa")
            except ValueError as err:
                if "sdpa" not in str(err).lower():
                    raise
                model = load()  # an architecture without sdpa support (T5)
    except Exception as err:
        what = "an encoder-decoder (seq2seq)" if kind == "seq2seq" else "a causal-LM"
        raise UsageError(f"MODEL_PATH={path}: not {what} model folder: {_first_line(err)}") from None
    state_dict.refuse_non_finite(model.state_dict(), f"MODEL_PATH={path}")  # NaN in, NaN out: refused here
    return model, tok


def model_label(path: Path, model) -> str:
    """summary.json's model_size: the source run's size where MODEL_PATH is a kit run's final/."""
    try:
        return str(json.loads((path.parent / "summary.json").read_text())["model_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return model.config.model_type


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
        decide("decoder_start_token_id", c.pad_token_id, "MODEL_PATH's config.json has none: the pad id, as T5 starts its decoder")


def chat_tokens(tok, template: str | None = None) -> int:
    """TEMPLATE's chat tokens in the tokenizer (how many were added): the one place a loaded model's
    tokenizer (prepare_model) and a new model's (sft_scratch, before it sizes the vocabulary) get them."""
    return ensure_special_tokens(tok, template)


def prepare_model(model, tok, gradient_checkpointing: bool, decide, template: str | None = None) -> None:
    """Chat-template tokens (TEMPLATE's) in the tokenizer and the embeddings, stop tokens, training mode."""
    added = chat_tokens(tok, template)
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
            f"resized embeddings {rows} -> {model.get_input_embeddings().num_embeddings} for {added} chat-template "
            "token(s) (a multiple of 64; new rows drawn around the mean of the old)",
        )
    # Saved with final/: a plain model.generate() then stops at the end of the assistant's turn.
    model.generation_config.eos_token_id = stop_token_ids(tok)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.config.use_cache = False  # the KV cache only costs memory in training
    if model_lib.is_seq2seq(model):
        _decoder_ids(model, tok, decide)
    if not model_lib.is_seq2seq(model) and getattr(model, "loss_type", None) is None:
        model.loss_type = "ForCausalLM"  # as pretraining sets it; left unset, transformers warns each run
    if gradient_checkpointing:
        model_lib.enable_checkpointing(model)
    model.train()  # from_pretrained returns the model in eval mode (dropout off)
