"""SFT conversations tokenized once, into CACHE_DIR/sft/<key>/, on the chat library's keyed cache engine
(cache.py), and read back memory-mapped; SFTDataset gives them (or a list of encoded examples) to the
samplers.

Once every record was read into RAM and tokenized again on every rank (100k alpaca records: a minute and
1.5 GB before the first step). Now the first run writes
  ids.bin      every conversation's token ids, back to back (uint16, or uint32 for big vocabularies)
  trained.bin  one byte per token: 1 where the loss counts (assistant content), 0 elsewhere
  lengths.bin  tokens per conversation (int32)
  meta.json    the manifest, written last: counts, dtype, format, records skipped, truncated and
               unfit, and each file's sha256 (taken as it is written)
and every later run with the same key maps them at once. The key covers what changes the ids: the data's
bytes, the tokenizer (vocabulary, merges, added tokens), the chat template, TEMPLATE, LOSS_ON, TRUNCATION,
REASONING, MAX_LENGTH, SKIP_BAD_RECORDS and the model's layout (Layout.name): for an encoder-decoder (T5,
BART) an example is a (source, target) pair (encode.encode_pairs), ids.bin holds the source then the
target, trained.bin is 1 on the target, and source_lengths.bin (int32) says where the target starts. Only
lengths are held in RAM.

"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import numpy as np
from torch.utils.data import Dataset

from train.core.errors import UsageError
from train.core.units import IGNORE_INDEX
from train.data.chat import cache
from train.data.chat.cache import (
    CachedRows,
    Store,
    build_into,
    encoded_chunks,
    ids_dtype,
    keyed_cache,
    manifest_of,
    open_files,
    write_files,
)
from train.data.chat.encode import Rendering, Tally, encode
from train.data.chat.formats import converted, open_records, refuse_bad
from train.models.family import CAUSAL_LM

_FILES = ("ids.bin", "trained.bin", "lengths.bin")
SOURCE_LENGTHS = "source_lengths.bin"  # seq2seq caches only
FILES_OF = {"causal": _FILES, "seq2seq": (*_FILES, SOURCE_LENGTHS)}  # each layout's files (Layout.name)

@dataclass(frozen=True)
class Manifest:
    n: int  # conversations
    n_tokens: int
    dtype: str
    format: str
    n_skipped: int
    n_truncated: int
    first_error: str  # the first skipped record's place and reason ("" when none)
    n_tools_kept: int  # records with a tools list whose history was cut (the tools list kept)
    n_unfit: int  # records that cannot fit MAX_LENGTH (a tools list or system turn filling it): skipped
    first_unfit: str  # the first one's place and reason ("" when none)
    kind: str  # Layout.name: "causal" (conversations) or "seq2seq" ((source, target) pairs)
    sha256: dict  # file name -> the sha256 of its bytes


class CachedExamples(CachedRows):
    """The cached conversations lo..hi as a sequence of {"input_ids", "labels"} (lists, as
    encode_conversations gives them; for seq2seq the source and the target, as encode_pairs does)."""

    item = "example"

    def __init__(
        self, folder: Path, meta: Manifest, lo: int = 0, hi: int | None = None, lengths=None, sources=None
    ):
        super().__init__(folder, meta, lo, hi)
        if lengths is None:
            lengths = np.fromfile(self.folder / "lengths.bin", dtype=np.int32)
        if sources is None and SOURCE_LENGTHS in FILES_OF[meta.kind]:
            sources = np.fromfile(self.folder / SOURCE_LENGTHS, dtype=np.int32)
        self._all_lengths, self._all_sources = lengths, sources

    @property
    def lengths(self) -> np.ndarray:
        return self._all_lengths[self.lo : self.hi]

    @property
    def source_lengths(self) -> np.ndarray | None:
        """Source tokens of each pair (seq2seq); None for conversations."""
        return None if self._all_sources is None else self._all_sources[self.lo : self.hi]

    def _row_tokens(self) -> np.ndarray:
        return self._all_lengths

    def _view(self, lo: int, hi: int) -> CachedExamples:
        return CachedExamples(self.folder, self.meta, lo, hi, self._all_lengths, self._all_sources)

    def _example(self, k: int, start: int, end: int) -> dict:
        ids, labels = self._tokens(start, end)
        if self._all_sources is not None:  # a pair: the source, then the target (every token a label)
            cut = int(self._all_sources[k])
            return {"input_ids": ids[:cut].tolist(), "labels": ids[cut:].tolist()}
        return {"input_ids": ids.tolist(), "labels": labels.tolist()}


def open_cache(
    folder: Path, verify: bool = True, vocab: int | None = None
) -> tuple[CachedExamples | None, str | None]:
    """(examples, None) for a sound cache; (None, what is wrong) for a damaged one; (None, None)
    when there is none. verify: check the files' sha256, and ids.bin's ids against vocab, once
    (see the module doc): a meta.json rewritten to match poisoned files still meets the latter."""
    def rows_bytes(meta: Manifest) -> dict:
        return {name: meta.n * 4 for name in FILES_OF[meta.kind] if name in ("lengths.bin", SOURCE_LENGTHS)}

    meta, why = open_files(
        folder, "the SFT cache", manifest_of(Manifest), lambda m: FILES_OF[m.kind], rows_bytes, vocab, verify
    )
    if meta is None:
        return None, why
    examples = CachedExamples(folder, meta)
    if int(examples.lengths.sum(dtype=np.int64)) != meta.n_tokens or (examples.lengths < 0).any():
        return None, "lengths.bin does not add up to the token count"
    sources = examples.source_lengths
    if sources is not None and not ((sources >= 0) & (sources <= examples.lengths)).all():
        return None, f"{SOURCE_LENGTHS} does not fit lengths.bin"
    return examples, None


def _conversation_arrays(examples: list[dict]) -> tuple:
    """A causal LM's conversations -> (ids, trained, lengths, None)."""
    lengths = np.fromiter((len(e["input_ids"]) for e in examples), dtype=np.int32, count=len(examples))
    labels = np.fromiter(
        chain.from_iterable(e["labels"] for e in examples), dtype=np.int64, count=int(lengths.sum())
    )
    ids = np.fromiter(
        chain.from_iterable(e["input_ids"] for e in examples), dtype=np.int64, count=len(labels)
    )
    return ids, (labels != IGNORE_INDEX).astype(np.uint8), lengths, None


def _source_target_arrays(examples: list[dict]) -> tuple:
    """An encoder-decoder's (source, target) pairs -> (ids, trained, lengths, source lengths)."""
    sources = np.fromiter((len(e["input_ids"]) for e in examples), dtype=np.int32, count=len(examples))
    targets = np.fromiter((len(e["labels"]) for e in examples), dtype=np.int32, count=len(examples))
    lengths = sources + targets
    ids = np.fromiter(
        chain.from_iterable(chain(e["input_ids"], e["labels"]) for e in examples),
        dtype=np.int64,
        count=int(lengths.sum()),
    )
    flags = chain.from_iterable(chain([0] * len(e["input_ids"]), [1] * len(e["labels"])) for e in examples)
    return ids, np.fromiter(flags, dtype=np.uint8, count=len(ids)), lengths, sources


def _encode_chunk(chunk: list[tuple[str, object]]):
    """A chunk of (place, record) -> (ids, trained, lengths, source lengths or None, (truncated, tools kept,
    unfit), bad); unfit and bad: "place: reason" of each such record."""
    tok, fmt, max_length, layout, rendering = cache._WORKER  # set by cache.py's worker initializer
    conversations, places, bad = [], [], []
    for place, record in chunk:  # one at a time: a conversation encode refuses is named by its place
        good, worse = converted([(place, record)], fmt)
        conversations += good  # in place: a new list per record made each chunk quadratic
        places += [place] * len(good)
        bad += worse
    tally = Tally()
    examples, n_cut = encode(conversations, tok, max_length, layout, rendering, tally)
    bad += [f"{places[i]}: {reason}" for i, reason in tally.refused]
    counts = (n_cut, tally.tools_kept, [f"{places[i]}: {reason}" for i, reason in tally.unfit])
    return *layout.pick(_conversation_arrays, _source_target_arrays)(examples), counts, bad


def _progress(total: int | None):
    from tqdm import tqdm

    return tqdm(total=total, desc="tokenizing SFT data", unit=" rows", unit_scale=True, leave=False,
                disable=None, mininterval=1.0)


def _write(tmp: Path, items: Iterator, tok, fmt: str, max_length: int, workers: int, skip: bool,
           total: int | None, layout, rendering: Rendering | None = None) -> Manifest:
    """Tokenize every record into tmp's files (fsynced); returns the manifest's content."""
    dtype = ids_dtype(tok)
    t = dict(n=0, n_tokens=0, n_skipped=0, n_truncated=0, n_tools_kept=0, n_unfit=0, first_error="",
             first_unfit="")

    def parts():
        with _progress(total) as bar:
            for ids, trained, lengths, sources, (truncated, tools_kept, unfit), bad in encoded_chunks(
                    items, _encode_chunk, tok, fmt, max_length, workers, layout, rendering):
                if bad and not skip:
                    raise refuse_bad(bad[0])
                t["first_error"] = t["first_error"] or (bad or [""])[0]
                t["first_unfit"] = t["first_unfit"] or (unfit or [""])[0]
                yield {"ids.bin": ids.astype(dtype), "trained.bin": trained, "lengths.bin": lengths,
                       **({} if sources is None else {SOURCE_LENGTHS: sources})}  # fmt: skip
                counts = {
                    "n": len(lengths),
                    "n_tokens": len(ids),
                    "n_skipped": len(bad),
                    "n_truncated": truncated,
                    "n_tools_kept": tools_kept,
                    "n_unfit": len(unfit),
                }
                for name, count in counts.items():
                    t[name] += count
                bar.update(len(lengths) + len(bad) + len(unfit))

    sums = write_files(tmp, FILES_OF[layout.name], parts())
    return Manifest(**t, dtype=np.dtype(dtype).name, format=fmt, kind=layout.name, sha256=sums)


def build(folder: Path, items: Iterator, tok, fmt: str, max_length: int, workers: int, skip: bool,
          total: int | None, data_name: str, layout=CAUSAL_LM, rendering=None) -> CachedExamples:
    """Write the cache for `items` into `folder` (build_into: atomic, manifest last)."""
    def fits(meta: Manifest) -> None:
        # A few records too long for this model are skipped; most, or all, stop the run, unless
        # SKIP_BAD_RECORDS=1 asked for the skip: then what fits trains (the SFT door says how much did not).
        if meta.n_unfit > meta.n and (not skip or meta.n == 0):
            hint = "" if skip else f" (SKIP_BAD_RECORDS=1 trains on the {meta.n} that fit)" if meta.n else ""
            raise UsageError(f"DATA_PATH: {data_name}: {meta.n_unfit} of {meta.n_unfit + meta.n} records "
                             f"cannot fit "
                             f"this model at MAX_LENGTH={max_length}{hint}; the first: {meta.first_unfit}")

    def write(tmp: Path) -> Manifest:
        return _write(tmp, items, tok, fmt, max_length, workers, skip, total, layout, rendering)

    return build_into(STORE, folder, write, data_name, fits)


STORE = Store("SFT", "sft", FILES_OF["seq2seq"], open_cache, build,
              "built-in")


def sft_cache(data_path: str | None, builtin: list | None, tok, max_length: int, skip_bad_records: bool,
              cache_dir: Path, workers: int, say, layout=CAUSAL_LM,
              rendering: Rendering | None = None, text_field: str = "text") -> tuple[CachedExamples, str]:
    """The SFT cache for this data, tokenizer, rendering (TEMPLATE, LOSS_ON ...), MAX_LENGTH and model
    layout: keyed_cache's, with the records read as SFT's formats (a plain-text record trains on
    TEXT_FIELD)."""
    def opened():
        if data_path is None:
            return "messages", ((f"built-in pair {i}", {"messages": c}) for i, c in enumerate(builtin, 1))
        return open_records(data_path, text_field, skip_bad_records)

    # what a plain-text record trains on
    key = (lambda k: k + f"\0text_field={text_field}") if text_field != "text" else str
    return keyed_cache(STORE, data_path, builtin, opened, tok, max_length, skip_bad_records, cache_dir,
                       workers, say, layout, rendering, key)


class SFTDataset(Dataset):
    """Encoded examples ({"input_ids", "labels"}): the SFT cache's memory-mapped view (CachedExamples), or a
    list in memory; lengths (a numpy array) for the samplers. An encoder-decoder's (its layout's) examples are
    (source, target) pairs whose labels are the target: lengths are source + target, and source_lengths the
    sources (None for conversations)."""

    def __init__(self, examples, layout=CAUSAL_LM):
        self.examples, self.layout = examples, layout
        lengths, sources = getattr(examples, "lengths", None), getattr(examples, "source_lengths", None)
        if lengths is None:
            sources = [len(e["input_ids"]) for e in examples]
            lengths = layout.pick(
                sources, [n + len(e["labels"]) for n, e in zip(sources, examples, strict=True)]
            )
            sources = layout.pick(None, sources)
        self.lengths = np.asarray(lengths)
        self.source_lengths = None if sources is None else np.asarray(sources)

    @property
    def unit(self) -> str:
        """What one example is, for the log."""
        return self.layout.pick("conversations", "source -> target pairs")

    @property
    def budget_note(self) -> str:
        """What TOKEN_BUDGET counts of a batch of these, beyond rows x longest."""
        return self.layout.pick("", " (rows x (longest source + longest target))")

    def part(self, lo: int, hi: int) -> SFTDataset:
        """Examples lo..hi, a view (the held-out split)."""
        return SFTDataset(self.examples[lo:hi], self.layout)

    def side_lengths(self) -> dict:
        """Each side's lengths in tokens, for the log."""
        if self.source_lengths is None:
            return {"conversation": self.lengths}
        return {"source": self.source_lengths, "target": self.lengths - self.source_lengths}

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict:
        return self.examples[index]
