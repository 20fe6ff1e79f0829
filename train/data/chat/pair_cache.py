"""Preference pairs tokenized once, into CACHE_DIR/pref/<key>/, on the chat library's keyed cache engine
(cache.py: the key, the worker processes, the atomic build, the files checked once), and read back
memory-mapped:
  ids.bin      each pair's ids back to back: the prompt, the chosen reply, the rejected reply
               (seq2seq: the encoder source, then the two decoder targets)
  trained.bin  one byte per token: 1 where the loss counts (never on the prompt; on a reply's trained
               turns: a turn of loss_weight 0 or a tool result inside a reply is 0)
  lengths.bin  int32 (pairs, 3): the prompt's, the chosen reply's and the rejected reply's tokens
  meta.json    the manifest, written last: counts, dtype, format, kind, skipped / truncated / reply-cut
               pairs, the first skipped record, each file's sha256
The key is the SFT cache's, under its own version: a pair's ids change with what a conversation's do.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import numpy as np

from train.core.units import IGNORE_INDEX
from train.data.chat import cache
from train.data.chat.cache import (
    CachedRows,
    Store,
    build_into,
    ids_dtype,
    keyed_cache,
    manifest_of,
    open_files,
    write_files,
)
from train.data.chat.formats import refuse_bad
from train.data.chat.pair_encode import SIDES, encode
from train.data.chat.pair_formats import converted, open_pairs
from train.data.chat.templates import Rendering, Tally
from train.models.family import CAUSAL_LM

PREF_CACHE_VERSION = "1"
FILES = ("ids.bin", "trained.bin", "lengths.bin")


@dataclass(frozen=True)
class Manifest:
    n: int  # pairs
    n_tokens: int
    dtype: str
    format: str
    kind: str  # Layout.name: "causal" or "seq2seq"
    n_skipped: int
    n_truncated: int  # pairs cut to fit MAX_LENGTH (prompt or reply)
    n_reply_cut: int  # of them, pairs where a reply lost its end
    n_tools_kept: int  # pairs whose prompt was cut with its tools list kept
    first_error: str  # the first skipped record's place and reason ("" when none)
    sha256: dict


class CachedPairs(CachedRows):
    """The cached pairs lo..hi as a sequence of pair_encode's examples (prompt_ids, chosen_ids,
    chosen_labels, rejected_ids, rejected_labels)."""

    item = "pair"

    def __init__(self, folder: Path, meta: Manifest, lo: int = 0, hi: int | None = None, sides=None):
        super().__init__(folder, meta, lo, hi)
        if sides is None:
            sides = np.fromfile(self.folder / "lengths.bin", dtype=np.int32).reshape(-1, 3)
        self._all_sides = sides

    @property
    def sides(self) -> np.ndarray:
        """(pairs, 3): tokens of the prompt, the chosen reply and the rejected reply of each pair."""
        return self._all_sides[self.lo : self.hi]

    def _row_tokens(self) -> np.ndarray:
        return self._all_sides.sum(axis=1)

    def _view(self, lo: int, hi: int) -> CachedPairs:
        return CachedPairs(self.folder, self.meta, lo, hi, self._all_sides)

    def _example(self, k: int, at: int, end: int) -> dict:
        example = {}
        for name, n in zip(("prompt", *SIDES), self._all_sides[k].tolist(), strict=True):
            ids, labels = self._tokens(at, at + n)
            example[f"{name}_ids"] = ids.tolist()
            if name != "prompt":
                example[f"{name}_labels"] = labels.tolist()
            at += n
        return example


def open_cache(folder: Path, verify: bool = True, vocab: int | None = None):
    """(pairs, None) for a sound cache; (None, what is wrong) for a damaged one; (None, None) for none."""
    meta, why = open_files(folder, "the preference cache", manifest_of(Manifest), lambda m: FILES,
                           lambda m: {"lengths.bin": m.n * 12}, vocab, verify)
    if meta is None:
        return None, why
    pairs = CachedPairs(folder, meta)
    if int(pairs.sides.sum(dtype=np.int64)) != meta.n_tokens or (pairs.sides < 0).any():
        return None, "lengths.bin does not add up to the token count"
    return pairs, None


def _encode_chunk(chunk: list[tuple[str, object]]):
    """A chunk of (place, record) -> (ids, trained, sides, (truncated, reply cut, tools kept), bad)."""
    tok, fmt, max_length, layout, rendering = cache._WORKER  # set by cache.py's worker initializer
    pairs, places, bad = converted(chunk, fmt)
    tally = Tally()
    examples, n_cut, n_reply_cut = encode(pairs, tok, max_length, layout, rendering, tally)
    bad += [f"{places[i]}: {reason}" for i, reason in tally.refused]
    names = ("prompt_ids", "chosen_ids", "rejected_ids")
    sides = np.array([[len(e[name]) for name in names] for e in examples], dtype=np.int32).reshape(-1, 3)
    count = int(sides.sum())
    ids = np.fromiter(
        chain.from_iterable(e[name] for e in examples for name in names), dtype=np.int64, count=count
    )
    labels = chain.from_iterable(
        chain([IGNORE_INDEX] * len(e["prompt_ids"]), e["chosen_labels"], e["rejected_labels"])
        for e in examples
    )
    trained = (np.fromiter(labels, dtype=np.int64, count=count) != IGNORE_INDEX).astype(np.uint8)
    return ids, trained, sides, (n_cut, n_reply_cut, tally.tools_kept), bad


def _write(tmp: Path, items, tok, fmt: str, max_length: int, workers: int, skip: bool, layout,
           rendering: Rendering) -> Manifest:
    """Tokenize every record into tmp's files (fsynced); returns the manifest."""
    dtype = ids_dtype(tok)
    t = {"n": 0, "n_tokens": 0, "n_skipped": 0, "counts": np.zeros(3, dtype=np.int64), "first_error": ""}

    def parts():  # counts: truncated, reply cut, tools kept
        chunks = cache.encoded_chunks(items, _encode_chunk, tok, fmt, max_length, workers, layout, rendering)
        for ids, trained, sides, cut, bad in chunks:
            if bad and not skip:
                raise refuse_bad(bad[0])
            t["first_error"] = t["first_error"] or (bad[0] if bad else "")
            yield {"ids.bin": ids.astype(dtype), "trained.bin": trained, "lengths.bin": sides}
            for name, count in (("n", len(sides)), ("n_tokens", len(ids)), ("n_skipped", len(bad))):
                t[name] += count
            t["counts"] = t["counts"] + cut

    sums = write_files(tmp, FILES, parts())
    return Manifest(t["n"], t["n_tokens"], np.dtype(dtype).name, fmt, layout.name, t["n_skipped"],
                    *map(int, t["counts"]), t["first_error"], sums)


def build(folder: Path, items, tok, fmt: str, max_length: int, workers: int, skip: bool, total: int | None,
          data_name: str, layout, rendering: Rendering) -> CachedPairs:
    """Write the cache for `items` into `folder` (build_into: atomic, manifest last)."""
    def write(tmp: Path) -> Manifest:
        return _write(tmp, items, tok, fmt, max_length, workers, skip, layout, rendering)

    return build_into(STORE, folder, write, data_name)


STORE = Store("preference", "pref", FILES, open_cache, build, "the built-in pairs")


def preference_cache(
    data_path: str | None,
    builtin: list | None,
    tok,
    max_length: int,
    skip_bad_records: bool,
    cache_dir: Path,
    workers: int,
    say,
    layout=CAUSAL_LM,
    rendering: Rendering | None = None,
) -> tuple[CachedPairs, str]:
    """The preference cache for this data (DATA_PATH, or the built-in pairs when it is None), tokenizer,
    rendering, MAX_LENGTH and layout: keyed_cache's, with the records read as preference formats."""
    def opened():
        if data_path is None:
            return "prompt", ((f"built-in pair {i}", pair) for i, pair in enumerate(builtin, 1))
        return open_pairs(data_path, skip_bad_records)

    return keyed_cache(STORE, data_path, builtin, opened, tok, max_length, skip_bad_records, cache_dir,
                       workers, say, layout, rendering or Rendering(),
                       lambda k: f"pref-{PREF_CACHE_VERSION}\0{k}")
