"""Pretraining's front door: DATA_PATH (or the built-in corpus) -> tokenizer -> sharded token
cache -> packed windows -> the held-out split (VAL_FRACTION or VAL_PATH) -> span corruption for
an encoder-decoder, returned as Data (train/val datasets and their collator) for the one loader
factory. Takes the data config and plain values, never the Plan; imports train/core and
train/data only, never the root config.py."""

from __future__ import annotations

import math
from pathlib import Path

from torch.utils.data import Subset

from train.core.errors import UsageError
from train.core.seq2seq import corrupted_lengths, span_lengths
from train.core.units import cpu_cores
from train.data import records, span_corruption
from train.data import text as data
from train.data.chat.batching import Seq2SeqCollator
from train.data.holdout import VAL_ROWS, val_windows
from train.data.json_lines import record_limit, suffix_of
from train.data.loader import Data


def pretraining_data(
    d, tok, *, max_length: int, objective: str, eval_batches: int, seed: int, say, decide
) -> Data:
    """Token cache and the packed train / held-out datasets of data config `d`, tokenized by `tok`
    (train/data/tokenizer.py's corpus_tokenizer). objective: the family's (Family.objective): an
    encoder-decoder's (T5, BART ...) span_corruption trains on T5's span corruption of raw windows a little
    longer than MAX_LENGTH; its sentinels are
    added to the tokenizer here. NUM_WORKERS above the CPU cores is lowered in `d` (a decision)."""
    cache_dir = Path(d.cache_dir)
    with record_limit(d.max_record_mb):
        files = data.corpus_files(d.data_path)
        if d.data_path is not None:
            note_plain_text(files, "DATA_PATH", d.text_field, decide)
        key = data.corpus_fingerprint(files, d.text_field, cache_dir / "sums")  # remembered: no second read
        tokens = data.token_cache(files, key, tok, cache_dir, say, d.text_field, d.tokenize_workers)
    cores = cpu_cores()
    if d.num_workers > cores:
        decide("num_workers", cores, f"NUM_WORKERS={d.num_workers} but only {cores} CPU cores: more workers "
                                     f"only contend")
        d.num_workers = cores
    span = objective == span_corruption.OBJECTIVE
    window = span_lengths(max_length)[0] if span else max_length
    dataset = data.PackedDataset(tokens, window)
    dataset, val_dataset = split_pretraining(
        d, eval_batches, dataset, tok, cache_dir, max_length, say, decide, window
    )
    if not span:
        return Data(tokenizer=tok, dataset=dataset, val_dataset=val_dataset)
    # Sentinels after every token cache is built: the caches' key is the tokenizer GPT-2 runs share.
    sentinels, added = data.sentinel_ids(tok, span_corruption.sentinels_needed(window))
    source, target = corrupted_lengths(window)
    decide(
        "objective",
        "span corruption",
        f"T5's: raw windows of {window} tokens -> source {source}, target "
        f"{target} (15 % noise in spans of 3{f'; {added} sentinel tokens added' if added else ''})",
    )
    # The ids the model's config takes from this tokenizer: an encoder-decoder without a pad pads
    # (and starts its decoder) with end-of-text, as T5 does.
    eos = tok.convert_tokens_to_ids(tok.eos_token)
    pad = eos if tok.pad_token_id is None else tok.pad_token_id
    collate = Seq2SeqCollator(pad)  # the SFT pairs' collator: one batch contract
    return Data(
        tokenizer=tok,
        dataset=span_corruption.span_corrupted(dataset, sentinels, eos, seed),
        val_dataset=span_corruption.span_corrupted(val_dataset, sentinels, eos, seed),
        collate=collate,
        val_collate=collate,
    )


def note_plain_text(files: list[Path], variable: str, text_field: str, decide) -> None:
    """One decision line when sources of no known kind (a .csv, a .tsv, a .log) are read as plain
    text: every character of them is trained on, a CSV's commas, quotes and header line too, which
    a user who meant one column would otherwise find out from the samples (issue: a larger CSV
    trained silently)."""
    other = [f for f in files if records.is_text_file(f) and suffix_of(f) not in records.TEXT_SUFFIXES]
    if not other:
        return
    kinds = ", ".join(sorted({suffix_of(f) or "no suffix" for f in other}))
    more = f" and {len(other) - 1} more" if len(other) > 1 else ""
    decide(f"{variable.lower()}_format", f"plain text ({kinds})",
           f"{variable}: {other[0].name}{more} is not .txt/.md/.jsonl/.parquet/Arrow, so it is read as plain "
           f"text and "
           f"every character trained on: a CSV's commas, quotes and header line too; to train on one column, "
           f"convert it to JSONL or parquet with a {text_field} field (TEXT_FIELD)")  # fmt: skip


def split_pretraining(d, eval_batches: int, dataset, tok, cache_dir: Path, max_length: int, say, decide,
                      window: int | None = None):
    """(train dataset, validation dataset or None) for packed pretraining windows of `window`
    tokens (MAX_LENGTH, or the raw windows span corruption makes MAX_LENGTH-token sources of):
    VAL_PATH's own windows, or the last part of the token stream, so the two never overlap."""
    window = window or max_length
    if d.val_path is not None:
        with records.reading("VAL_PATH"), record_limit(d.max_record_mb):
            files = data.corpus_files(d.val_path)
            note_plain_text(files, "VAL_PATH", d.text_field, decide)
            key = data.corpus_fingerprint(files, d.text_field, cache_dir / "sums", "VAL_PATH")
            tokens = data.token_cache(files, key, tok, cache_dir, say, d.text_field, d.tokenize_workers)
        val = data.PackedDataset(tokens, window)
        if len(val) == 0:
            raw = f" (a raw window of {window} before span corruption)" if window != max_length else ""
            raise UsageError(f"VAL_PATH: {len(tokens)} tokens are fewer than one MAX_LENGTH={max_length} "
                             f"sequence{raw}")
        decide("validation", f"{len(val)} sequences", f"VAL_PATH={d.val_path}")
        return dataset, val
    want = eval_batches * VAL_ROWS
    n_val = val_windows(len(dataset), d.val_fraction, want)
    if n_val == 0:
        reason = "VAL_FRACTION=0" if d.val_fraction == 0 else "too little data to hold any out"
        decide("validation", "off", reason)
        return dataset, None
    n_train = len(dataset) - n_val
    reason = (
        f"the last {n_val / len(dataset):.1%} of the token stream (VAL_FRACTION={d.val_fraction:g}"
    )
    if n_val > math.ceil(d.val_fraction * len(dataset)):
        reason += f", raised towards EVAL_BATCHES x {VAL_ROWS} = {want}"
    decide("validation", f"{n_val} sequences", reason + "); never trained on")
    # Subset over a range pickles as two numbers, so workers still reopen the memmap.
    return Subset(dataset, range(n_train)), Subset(dataset, range(n_train, len(dataset)))
