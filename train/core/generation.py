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
from pathlib import Path

from train.core.errors import UsageError

VARIABLE = "GENERATION_CONFIG (--generation_config)"

# Values transformers' GenerationConfig accepts and generate() fails on only later (num_beams 0,
# a penalty of 0), or with a traceback: (kind, bound, what a user reads).
RANGES = {
    "max_new_tokens": (int, 1, "a whole number >= 1"),
    "min_new_tokens": (int, 0, "a whole number >= 0"),
    "num_beams": (int, 1, "a whole number >= 1"),
    "num_return_sequences": (int, 1, "a whole number >= 1"),
    "no_repeat_ngram_size": (int, 0, "a whole number >= 0 (0: off)"),
    "top_k": (int, 0, "a whole number >= 0"),
    "repetition_penalty": (float, 0.0, "a number > 0 (1.0: off)"),
    "temperature": (float, 0.0, "a number > 0"),
    "top_p": (float, 0.0, "a number > 0 and at most 1"),
}


def value_problem(key: str, value) -> str | None:
    """What is wrong with one generate() setting (the accepted values), or None."""
    if key not in RANGES:
        return None
    kind, bound, accepted = RANGES[key]
    if kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= bound
    else:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        ok = ok and value > bound and (key != "top_p" or value <= 1)
    return None if ok else f"expected {accepted}, got {value!r}"


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
        settings = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"{VARIABLE}: no such file: {path}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise UsageError(f"{VARIABLE}: cannot read {path}: {err}") from None
    except ValueError as err:
        raise UsageError(f"{VARIABLE}: {path} is not JSON ({err})") from None
    if not isinstance(settings, dict):
        raise UsageError(f"{VARIABLE}: {path} must hold a JSON object of generate() settings, e.g. {{\"num_beams\": 4}}")
    # a model's own generation_config.json is accepted as it is: its bookkeeping fields dropped
    settings = {k: v for k, v in settings.items() if not k.startswith("_") and k != "transformers_version"}
    unknown = sorted(set(settings) - known_settings())
    if unknown:
        raise UsageError(f"{VARIABLE}: {unknown[0]!r} in {path} is not a generate() setting of transformers' GenerationConfig")
    for key, value in settings.items():
        problem = value_problem(key, value)
        if problem:
            raise UsageError(f"{VARIABLE}: {key} in {path}: {problem}")
    if settings.get("use_cache") is False:  # final/ generates at full speed: the kit's contract
        raise UsageError(f"{VARIABLE}: use_cache false in {path} makes generate() many times slower; leave it out")
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
    for key in ("eos_token_id", "pad_token_id", "bos_token_id", "decoder_start_token_id"):
        ids = settings.get(key)
        ids = ids if isinstance(ids, list) else [ids]
        if any(isinstance(i, int) and not 0 <= i < rows for i in ids):  # generate() would index past the vocabulary
            raise UsageError(f"{VARIABLE}: {path}: {key} {settings[key]!r} is outside the model's {rows} tokens")
    model.generation_config.update(**settings)
    model.generation_config._from_model_config = False  # its own settings now, not config.json's copies
    decide("generation_config", dict(settings), f"GENERATION_CONFIG={path}, saved in final/generation_config.json")
