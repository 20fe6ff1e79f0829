"""The tokenizer's front door, one for every mode: a local one (TOKENIZER_PATH, or a saved
model's own folder: any AutoTokenizer directory, never running code from it unless
TRUST_REMOTE_CODE says so), or a byte-level BPE trained on a bounded sample of the data and cached
(pretraining: the corpus; SFT from scratch: every turn of the conversations, laid out at the
model config's own pad / eos ids). SFT then adds TEMPLATE's chat markers (chat_tokens), before
anything sizes a vocabulary. Takes the data config and plain values; imports train/core and
train/data only."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from train.core.errors import UsageError
from train.core.remote_code import refuse_custom_code
from train.data import records, tokenize
from train.data import text as text_lib
from train.data.chat.encode import ensure_special_tokens
from train.data.chat.formats import builtin_conversations, open_records, to_conversation
from train.data.chat.turns import BadRecord, call_text, split_tools
from train.data.json_lines import record_limit

# Part of the tokenizer cache's key: the same files give another BPE as SFT turns than as
# pretraining text.
TURNS_KEY = "sft-turns"


def corpus_tokenizer(d, say):
    """Pretraining's: TOKENIZER_PATH, or a BPE trained on (a sample of) DATA_PATH's text."""
    with record_limit(d.max_record_mb):
        files = text_lib.corpus_files(d.data_path)
        key = text_lib.corpus_fingerprint(files, d.text_field, Path(d.cache_dir) / "sums")
        tok = text_lib.load_tokenizer(d.tokenizer_path, files, key, d.vocab_size, Path(d.cache_dir), say,
                                      d.text_field, d.tokenizer_sample_mb)
        if d.data_path is not None:  # a tokenizer far costlier on this text than on its own: a note
            first = (
                p
                for _, unit, _ in tokenize.iter_units(files, d.text_field)
                for p in tokenize.unit_pieces(unit)
            )
            text_lib.language_note(tok, (p for p in first if p), say)
    return tok


def folder_tokenizer(folder, variable: str, trust_remote_code: bool, bare: bool = False):
    """A saved model's tokenizer (its folder, or TOKENIZER_PATH), offline; one line on failure."""
    from transformers import AutoTokenizer

    allow = ("TRUST_REMOTE_CODE=1 lets it run (or `python -m train import` writes its weights as a plain "
             "folder)")
    refuse_custom_code(folder, variable.split("=")[0], trust_remote_code, allow=allow)
    try:
        return AutoTokenizer.from_pretrained(
            folder, local_files_only=True, trust_remote_code=trust_remote_code
        )
    except Exception as err:  # transformers raises OSError, ValueError, KeyError... for a bad folder
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        also = "; a bare checkpoint's tokenizer is given with TOKENIZER_PATH" if bare else ""
        raise UsageError(f"{variable}: no tokenizer could be loaded: {first}{also}") from None


def turns_tokenizer(d, declared: dict, variable: str, say, decide):
    """SFT from scratch: TOKENIZER_PATH, or a BPE trained (and cached) on the SFT data's turns,
    laid out at the model config's own pad / eos ids (`declared`) where it sets small ones."""
    cache = Path(d.cache_dir)
    if d.tokenizer_path is not None:
        return text_lib.load_tokenizer(d.tokenizer_path, [], "", d.vocab_size, cache, say)
    if d.data_path is not None:
        # an unknown format, empty data or a bad first record stops here, before the BPE trains
        open_records(d.data_path, d.text_field, d.skip_bad_records)
    files = text_lib.builtin_corpus_files() if d.data_path is None else records.source_files(d.data_path)
    turns_key = TURNS_KEY if d.text_field == "text" else f"{TURNS_KEY}:{d.text_field}"  # which text it learns
    key = text_lib.corpus_fingerprint(files, turns_key, cache / "sums")
    layout = text_lib.special_layout(declared.get("pad_token_id"), declared.get("eos_token_id"))
    specials = layout or (text_lib.EOS,)
    if layout and layout != (text_lib.EOS,):
        decide("tokenizer_specials", list(layout), f"{variable}'s pad / eos ids, so its ids hold")
    return text_lib.load_tokenizer(
        None,
        files,
        key,
        d.vocab_size,
        cache,
        say,
        sample_mb=d.tokenizer_sample_mb,
        specials=specials,
        texts=lambda: turn_texts(d.data_path, d.tokenizer_sample_mb, d.text_field),
    )


def chat_tokens(tok, template: str | None = None) -> int:
    """TEMPLATE's chat tokens in the tokenizer (how many were added), before the vocabulary is
    sized (a new model) or the embeddings resized (a loaded one)."""
    return ensure_special_tokens(tok, template)


def turn_texts(data_path: str | None, sample_mb: float, text_field: str = "text") -> Iterator[str]:
    """Every turn's text of the SFT data (contents, tool calls, tools lists), up to
    TOKENIZER_SAMPLE_MB; records that are bad are passed over here (the SFT cache names them)."""
    if data_path is None:
        conversations = iter(builtin_conversations())
    else:
        fmt, items = open_records(data_path, text_field)
        conversations = _good(items, fmt)
    budget, taken = sample_mb * (1 << 20), 0
    for conversation in conversations:
        for piece in _conversation_texts(conversation):
            yield piece
            taken += len(piece.encode("utf-8"))
        if taken >= budget:
            return


def _good(items, fmt: str) -> Iterator[list[dict]]:
    for _, record in items:
        if isinstance(record, BadRecord):
            continue
        try:
            yield to_conversation(record, fmt)
        except BadRecord:
            continue


def _conversation_texts(conversation) -> Iterator[str]:
    tools, turns = split_tools(conversation)
    if tools:
        yield json.dumps(tools, ensure_ascii=False)
    for turn in turns:
        # every string a turn carries (its content, a reasoning part ...) but its role
        yield from (v for k, v in turn.items() if k != "role" and isinstance(v, str) and v)
        yield from (call_text(call) for call in turn.get("tool_calls") or ())
