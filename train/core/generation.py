"""generate() settings a model is saved with, and the ranges the kit checks them against.

GENERATION_CONFIG is a JSON file of transformers' generate() settings (ChatLM's recipe:
{"num_beams": 5, "repetition_penalty": 1.1, "no_repeat_ngram_size": 4, "max_new_tokens": 256});
read_generation_config checks it before any work, apply_generation_config lays it over the kit's
own settings (KV cache on, the eos and pad ids) on the model, so final/generation_config.json
carries it and a plain generate() on final/ decodes as the run asked. `python -m train
generate` checks its flags against the same ranges.
"""

from __future__ import annotations

import contextlib
import json
import math
import re

from train.core.errors import UsageError
from train.core.files import read_user_file

VARIABLE = "GENERATION_CONFIG (--generation_config)"

# Values transformers' GenerationConfig accepts and generate() fails on only later (num_beams 0,
# a penalty of 0), or with a traceback: (kind, bound, what a user reads). Beams and returned
# sequences multiply the batch generate() runs: a million asks for gigabytes before the first
# token, so they have a ceiling too (MAX_BEAMS; beam search past a few dozen finds nothing new).
MAX_BEAMS = 256
# Lengths in tokens: past a million, a length is a typo (1e12 was accepted and shipped in
# final/generation_config.json); apply_generation_config also holds them to the model's context.
MAX_TOKENS = 1 << 20
RANGES = {
    "max_new_tokens": (int, 1, f"a whole number from 1 to {MAX_TOKENS:,}"),
    "min_new_tokens": (int, 0, f"a whole number from 0 to {MAX_TOKENS:,}"),
    "max_length": (int, 1, f"a whole number from 1 to {MAX_TOKENS:,}"),
    "min_length": (int, 0, f"a whole number from 0 to {MAX_TOKENS:,}"),
    "num_beams": (int, 1, f"a whole number from 1 to {MAX_BEAMS}"),
    "num_return_sequences": (int, 1, f"a whole number from 1 to {MAX_BEAMS}"),
    "no_repeat_ngram_size": (int, 0, "a whole number >= 0 (0: off)"),
    "top_k": (int, 0, "a whole number >= 0"),
    "repetition_penalty": (float, 0.0, "a number > 0 (1.0: off)"),
    "temperature": (float, 0.0, "a number > 0"),
    "top_p": (float, 0.0, "a number > 0 and at most 1"),
}

CEILINGS = {"num_beams": MAX_BEAMS, "num_return_sequences": MAX_BEAMS, **{
    key: MAX_TOKENS for key in ("max_new_tokens", "min_new_tokens", "max_length", "min_length")}}


def value_problem(key: str, value) -> str | None:
    """What is wrong with one generate() setting (the accepted values), or None."""
    if key not in RANGES:
        return None
    kind, bound, accepted = RANGES[key]
    if kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= bound
        ok = ok and value <= CEILINGS.get(key, value)
    else:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        ok = ok and value > bound and (key != "top_p" or value <= 1)
    return None if ok else f"expected {accepted}, got {value!r}"


# Settings that hold token ids: an int, or lists of them (bad_words_ids: lists of lists).
ID_SETTINGS = (
    "eos_token_id",
    "pad_token_id",
    "bos_token_id",
    "decoder_start_token_id",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "suppress_tokens",
    "begin_suppress_tokens",
    "bad_words_ids",
    "force_words_ids",
)
# transformers 5 runs these decodings as code fetched from the Hub (a custom_generate repository):
# the kit runs no downloaded code, so they are refused rather than tried.
REMOTE_DECODING = {"penalty_alpha": "contrastive search", "dola_layers": "DoLa decoding",
                   "num_beam_groups": "group beam search", "force_words_ids": "constrained beam search",
                   "constraints": "constrained beam search"}


# list depth
ID_LISTS = {"suppress_tokens": 1, "begin_suppress_tokens": 1, "bad_words_ids": 2, "force_words_ids": 2}


def _shaped(value, depth: int) -> bool:
    """A non-empty list (of non-empty lists, depth 2) where transformers indexes one."""
    if depth == 0:
        return True
    return isinstance(value, list) and bool(value) and all(_shaped(v, depth - 1) for v in value)


def _ids(value) -> list | None:
    """Every id in a token-id setting, or None where it holds anything but whole numbers >= 0."""
    if isinstance(value, int) and not isinstance(value, bool):
        return [value] if value >= 0 else None
    if isinstance(value, list):
        found = [_ids(v) for v in value]
        return None if any(f is None for f in found) else [i for f in found for i in f]
    return None


def settings_problem(settings: dict, vocab: int | None = None) -> tuple[str, str] | None:
    """(key, what is wrong) for the first bad generate() setting: a value out of RANGES, a
    decoding transformers runs as remote code, a token id that is not a whole number >= 0 (or,
    vocab given, not one of the model's ids); None when all are fine."""
    for key, value in settings.items():
        problem = value_problem(key, value)
        if problem:
            return key, problem
        if (
            key in REMOTE_DECODING
            and value not in (None, False, 0, [])
            and not (key == "num_beam_groups" and value == 1)
        ):
            return key, (f"{REMOTE_DECODING[key]} runs as code fetched from the Hub in transformers 5, which "
                         f"the kit never runs; leave it out")
        if key in ID_SETTINGS and value is not None:
            ids = _ids(value)
            if ids is None or not _shaped(value, ID_LISTS.get(key, 0)):
                return key, f"expected token ids (whole numbers >= 0, or lists of them), got {value!r}"
            if vocab is not None and any(i >= vocab for i in ids):
                return key, f"{value!r} is outside the model's {vocab} tokens"
        if key == "sequence_bias" and value is not None:
            pairs = value if isinstance(value, list) else None
            ok = pairs is not None and all(isinstance(p, list) and len(p) == 2 and _ids(p[0]) for p in pairs)
            bad = not ok or (vocab is not None and any(i >= vocab for p in pairs for i in _ids(p[0])))
            if bad:
                return key, (f"expected [[token ids], bias] pairs of the model's {vocab or ''} tokens, got "
                             f"{value!r}")
    return None


def known_settings() -> set[str]:
    from transformers import GenerationConfig

    return {name for name in vars(GenerationConfig()) if not name.startswith("_")} - {"transformers_version"}


@contextlib.contextmanager
def _quiet():
    """transformers logs each invalid flag as a warning before raising; the error says it once."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)


def read_generation_config(path: str | None) -> dict:
    """GENERATION_CONFIG's settings, checked key by key and as a whole by transformers'
    GenerationConfig.validate(strict=True); {} when unset. A bad file, an unknown key or a bad
    value is one line naming GENERATION_CONFIG and the key."""
    if path is None:
        return {}
    try:
        settings = json.loads(read_user_file(path, VARIABLE).decode("utf-8"))
    except FileNotFoundError:
        raise UsageError(f"{VARIABLE}: no such file: {path}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise UsageError(f"{VARIABLE}: cannot read {path}: {err}") from None
    except RecursionError:
        raise UsageError(f"{VARIABLE}: {path} is nested too deep to be generate() settings") from None
    except ValueError as err:
        raise UsageError(f"{VARIABLE}: {path} is not JSON ({err})") from None
    if not isinstance(settings, dict):
        raise UsageError(f"{VARIABLE}: {path} must hold a JSON object of generate() settings, e.g. "
                         f"{{\"num_beams\": 4}}")
    # a model's own generation_config.json is accepted as it is: its bookkeeping fields dropped
    settings = {k: v for k, v in settings.items() if not k.startswith("_") and k != "transformers_version"}
    unknown = sorted(set(settings) - known_settings())
    if unknown:
        raise UsageError(f"{VARIABLE}: {unknown[0]!r} in {path} is not a generate() setting of transformers' "
                         f"GenerationConfig")
    problem = settings_problem(settings)
    if problem:
        raise UsageError(f"{VARIABLE}: {problem[0]} in {path}: {problem[1]}")
    if settings.get("use_cache") is False:  # final/ generates at full speed: the kit's contract
        raise UsageError(f"{VARIABLE}: use_cache false in {path} makes generate() many times slower; leave "
                         f"it out")
    _validate(settings, path)
    return settings


def _validate(settings: dict, path: str) -> None:
    from transformers import GenerationConfig

    try:
        with _quiet():
            GenerationConfig(**settings).validate(strict=True)
    except (ValueError, TypeError) as err:
        text = str(err).replace("GenerationConfig is invalid:", "").strip()
        first = (text.splitlines() or [type(err).__name__])[0].lstrip("- ")
        key = re.search(r"`(\w+)`", first)
        name = key.group(1) if key else "a setting"
        reason = first.split(":", 1)[1].strip() if key and first.startswith(f"`{name}`:") else first
        raise UsageError(f"{VARIABLE}: {name} in {path}: {reason}") from None


def apply_generation_config(model, settings: dict, decide, path: str | None) -> None:
    """GENERATION_CONFIG's settings over the model's generation config (the kit's: the KV cache
    on when saved, the eos and pad ids of the tokenizer), recorded as a decision in config.json."""
    if not settings:
        return
    rows = model.get_input_embeddings().num_embeddings
    problem = settings_problem(settings, rows)  # generate() would index past the vocabulary
    if problem:
        raise UsageError(f"{VARIABLE}: {path}: {problem[0]} {problem[1]}")
    # A position table ends there: GPT-2 indexes past it (an IndexError mid-generate), a rotary model
    # reads positions it never trained on. T5's relative positions have no such end.
    name = next(
        (n for n in ("n_positions", "max_position_embeddings") if getattr(model.config, n, None)), None
    )
    context = getattr(model.config, name) if name else None
    for key in ("max_length", "max_new_tokens", "min_length", "min_new_tokens"):
        if context and isinstance(settings.get(key), int) and settings[key] > context:
            raise UsageError(f"{VARIABLE}: {key} {settings[key]:,} in {path} is past the model's context of "
                             f"{context:,} tokens ({name}); generate() cannot go past it")
    model.generation_config.update(**settings)
    model.generation_config._from_model_config = False  # its own settings now, not config.json's copies
    decide("generation_config", dict(settings), f"GENERATION_CONFIG={path}, saved in "
                                                f"final/generation_config.json")
