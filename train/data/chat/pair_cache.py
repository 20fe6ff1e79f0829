"""Preference pairs tokenized once, into CACHE_DIR/pref/<key>/, and read back memory-mapped.

The SFT cache's design (train/data/chat/cache.py), for pairs; its machinery is called, not copied:
the records stream in chunks to TOKENIZE_WORKERS processes (cache.encoded_chunks, with this
module's chunk encoder), the main process writes the results in record order into a temporary folder
that is fsynced and renamed into place, and a later run maps the files at once after checking them
against their sha256 (cache_files.verify_sums: once, then remembered by size, mtime, ctime and inode).
  ids.bin      each pair's ids back to back: the prompt, the chosen reply, the rejected reply
               (seq2seq: the encoder source, then the two decoder targets)
  trained.bin  one byte per token: 1 where the loss counts (never on the prompt; on a reply's trained
               turns: a turn of loss_weight 0 or a tool result inside a reply is 0)
  lengths.bin  int32 (pairs, 3): the prompt's, the chosen reply's and the rejected reply's tokens
  meta.json    the manifest, written last: counts, dtype, format, kind, skipped / truncated / reply-cut
               pairs, the first skipped record, each file's sha256
The key covers what changes the ids: the data's bytes, the tokenizer and its chat template, TEMPLATE,
TRUNCATION, REASONING, MAX_LENGTH, SKIP_BAD_RECORDS and the model kind. A damaged cache is said, removed
and built again; a link at one of its names is never followed.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import numpy as np

from train.core.units import IGNORE_INDEX
from train.data import cache_files
from train.data.chat import cache
from train.data.chat.formats import all_bad, refuse_bad
from train.data.chat.pair_encode import SIDES, encode
from train.data.chat.pair_formats import converted, open_pairs
from train.data.chat.templates import Rendering, Tally

PREF_CACHE_VERSION = "1"
FILES = ("ids.bin", "trained.bin", "lengths.bin")


@dataclass(frozen=True)
class Manifest:
    n: int  # pairs
    n_tokens: int
    dtype: str
    format: str
    kind: str  # "causal" or "seq2seq"
    n_skipped: int
    n_truncated: int  # pairs cut to fit MAX_LENGTH (prompt or reply)
    n_reply_cut: int  # of them, pairs where a reply lost its end
    n_tools_kept: int  # pairs whose prompt was cut with its tools list kept
    first_error: str  # the first skipped record's place and reason ("" when none)
    sha256: dict


class CachedPairs:
    """The cached pairs lo..hi as a sequence of pair_encode's examples (prompt_ids, chosen_ids,
    chosen_labels, rejected_ids, rejected_labels), read from the memmaps on demand. A slice is a view
    of the same files (a validation split copies nothing); it pickles as its file names, so the
    DataLoader's workers map the files themselves."""

    def __init__(self, folder: Path, meta: Manifest, lo: int = 0, hi: int | None = None, sides=None):
        self.folder, self.meta = Path(folder), meta
        self.lo, self.hi = lo, meta.n if hi is None else hi
        if sides is None:
            sides = np.fromfile(self.folder / "lengths.bin", dtype=np.int32).reshape(-1, 3)
        self._all_sides = sides
        self._offsets = self._ids = self._trained = None

    @property
    def sides(self) -> np.ndarray:
        """(pairs, 3): tokens of the prompt, the chosen reply and the rejected reply of each pair."""
        return self._all_sides[self.lo : self.hi]

    def __len__(self) -> int:
        return self.hi - self.lo

    def _open(self) -> None:
        self._offsets = np.concatenate([[0], np.cumsum(self._all_sides.sum(axis=1), dtype=np.int64)])
        shape, dtype = (self.meta.n_tokens,), np.dtype(self.meta.dtype)
        self._ids = np.memmap(self.folder / "ids.bin", dtype=dtype, mode="r", shape=shape)
        self._trained = np.memmap(self.folder / "trained.bin", dtype=np.uint8, mode="r", shape=shape)

    def __getitem__(self, index):
        if isinstance(index, slice):
            lo, hi, step = index.indices(len(self))
            if step != 1:
                raise ValueError("cached pairs slice with step 1 only")
            return CachedPairs(self.folder, self.meta, self.lo + lo, self.lo + max(lo, hi), self._all_sides)
        if not -len(self) <= index < len(self):
            raise IndexError(f"pair {index} of {len(self)}")
        if self._ids is None:
            self._open()
        k = self.lo + index % len(self)
        at = int(self._offsets[k])
        example = {}
        for name, n in zip(("prompt", *SIDES), self._all_sides[k].tolist(), strict=True):
            ids = np.asarray(self._ids[at : at + n], dtype=np.int64)
            example[f"{name}_ids"] = ids.tolist()
            if name != "prompt":
                example[f"{name}_labels"] = np.where(self._trained[at : at + n] != 0, ids, IGNORE_INDEX).tolist()
            at += n
        return example

    def __getstate__(self):
        return {**self.__dict__, "_ids": None, "_trained": None, "_offsets": None}


def _manifest(raw: dict) -> Manifest:
    meta = Manifest(**{k: raw[k] for k in Manifest.__dataclass_fields__})
    if np.dtype(meta.dtype) not in (np.dtype(np.uint16), np.dtype(np.uint32)):
        raise ValueError(f"ids of type {meta.dtype}, not the kit's uint16 / uint32")
    return meta


def open_cache(folder: Path, verify: bool = True, vocab: int | None = None):
    """(pairs, None) for a sound cache; (None, what is wrong) for a damaged one; (None, None) for none."""
    if not folder.exists():
        return None, None
    read, why = cache_files.read_manifest(folder, "the preference cache", _manifest, lambda meta: FILES)
    if read is None:
        return None, why
    meta, sizes = read
    dtype = np.dtype(meta.dtype)
    expected = {"ids.bin": meta.n_tokens * dtype.itemsize, "trained.bin": meta.n_tokens, "lengths.bin": meta.n * 12}
    for name, size in expected.items():
        if sizes[name] != size:
            return None, f"{name} holds {sizes[name]:,} bytes, meta.json says {size:,}"

    def in_vocab(name: str) -> str | None:
        top = int(np.memmap(folder / name, dtype=dtype, mode="r").max()) if name == "ids.bin" and sizes[name] else -1
        return f"ids.bin holds id {top}, outside the tokenizer's {vocab} ids" if vocab and top >= vocab else None

    damage = cache_files.verify_sums(folder, meta.sha256, FILES, in_vocab) if verify else None
    if damage:
        return None, damage
    pairs = CachedPairs(folder, meta)
    if int(pairs.sides.sum(dtype=np.int64)) != meta.n_tokens or (pairs.sides < 0).any():
        return None, "lengths.bin does not add up to the token count"
    return pairs, None


def _encode_chunk(chunk: list[tuple[str, object]]):
    """A chunk of (place, record) -> (ids, trained, sides, (truncated, reply cut, tools kept), bad)."""
    tok, fmt, max_length, kind, rendering = cache._WORKER  # set by cache's worker initializer
    pairs, places, bad = converted(chunk, fmt)
    tally = Tally()
    examples, n_cut, n_reply_cut = encode(pairs, tok, max_length, kind, rendering, tally)
    bad += [f"{places[i]}: {reason}" for i, reason in tally.refused]
    names = ("prompt_ids", "chosen_ids", "rejected_ids")
    sides = np.array([[len(e[name]) for name in names] for e in examples], dtype=np.int32).reshape(-1, 3)
    count = int(sides.sum())
    ids = np.fromiter(chain.from_iterable(e[name] for e in examples for name in names), dtype=np.int64, count=count)
    labels = chain.from_iterable(chain([IGNORE_INDEX] * len(e["prompt_ids"]), e["chosen_labels"], e["rejected_labels"])
                                 for e in examples)  # fmt: skip
    trained = (np.fromiter(labels, dtype=np.int64, count=count) != IGNORE_INDEX).astype(np.uint8)
    return ids, trained, sides, (n_cut, n_reply_cut, tally.tools_kept), bad


def _write(tmp: Path, items, tok, fmt: str, max_length: int, workers: int, skip: bool, kind: str,
           rendering: Rendering) -> Manifest:
    """Tokenize every record into tmp's files (fsynced); returns the manifest."""
    dtype = np.uint16 if len(tok) <= 65535 else np.uint32
    n = n_tokens = n_skipped = 0
    counts = np.zeros(3, dtype=np.int64)  # truncated, reply cut, tools kept
    first_error = ""
    with contextlib.ExitStack() as stack:
        out = {name: cache_files.Hashed(stack.enter_context(open(tmp / name, "wb"))) for name in FILES}
        chunks = cache.encoded_chunks(items, tok, fmt, max_length, workers, kind, rendering, encode=_encode_chunk)
        for ids, trained, sides, cut, bad in chunks:
            if bad and not skip:
                raise refuse_bad(bad[0])
            first_error = first_error or (bad[0] if bad else "")
            out["ids.bin"].write(ids.astype(dtype).tobytes())
            out["trained.bin"].write(trained.tobytes())
            out["lengths.bin"].write(sides.tobytes())
            n, n_tokens, n_skipped, counts = n + len(sides), n_tokens + len(ids), n_skipped + len(bad), counts + cut
        for handle in out.values():
            handle.flush()
            os.fsync(handle.fileno())
    sums = {name: handle.digest.hexdigest() for name, handle in out.items()}
    return Manifest(n, n_tokens, np.dtype(dtype).name, fmt, kind, n_skipped, *map(int, counts), first_error, sums)


def build(folder: Path, items, tok, fmt: str, max_length: int, workers: int, skip: bool, data_name: str,
          kind: str, rendering: Rendering) -> CachedPairs:
    """Write the cache for `items` into `folder`, atomically (a temporary folder, manifest last, fsynced,
    renamed); another run that finished the same cache first wins, and its copy is used."""
    cache_files.remove_abandoned(cache_files.cache_folder(folder.parent))
    with cache_files.building("tokenizing the preference data", "the preference cache", folder) as temps:
        tmp = cache_files.temp_folder(folder, temps)
        meta = _write(tmp, items, tok, fmt, max_length, workers, skip, kind, rendering)
        if meta.n == 0:
            raise all_bad(data_name, meta.n_skipped, meta.first_error)
        cache_files.publish(tmp, folder, meta.__dict__, temps, lambda f: open_cache(f)[0] is not None)
    pairs, damage = open_cache(folder, verify=False)  # hashed as it was written
    if pairs is None:
        raise OSError(f"the preference cache just written does not read back ({damage})")
    return pairs


def preference_cache(data_path: str | None, builtin: list | None, tok, max_length: int, skip_bad_records: bool,
                     cache_dir: Path, workers: int, say, kind: str = "causal",
                     rendering: Rendering | None = None) -> tuple[CachedPairs, str]:
    """The preference cache for this data (DATA_PATH, or the built-in pairs when it is None),
    tokenizer, rendering, MAX_LENGTH and model kind: opened when there is one, else built. Returns
    (pairs, what was done, for the log)."""
    start, rendering = time.perf_counter(), rendering or Rendering()
    root = cache_dir / "pref"
    cache_files.refuse_link(root, root / "sums")
    data_key, total = cache.data_fingerprint(data_path, builtin, root / "sums")
    key = cache.cache_key(f"pref-{PREF_CACHE_VERSION}\0{data_key}", tok, max_length, skip_bad_records, kind,
                              rendering)  # fmt: skip
    folder = root / key
    cache_files.drop_link(folder, say)
    for name in [folder / "meta.json", *(folder / f for f in FILES)] if folder.is_dir() else []:
        cache_files.drop_link(name, say)
    pairs, damage = open_cache(folder, vocab=len(tok))
    if pairs is not None:
        return pairs, f"preference cache: reused {folder} ({time.perf_counter() - start:.1f} s)"
    if damage:
        say(f"preference cache {folder} was damaged ({damage}); rebuilding")
        cache_files.remove(folder)
    if data_path is None:
        fmt, items = "prompt", ((f"built-in pair {i}", pair) for i, pair in enumerate(builtin, 1))
    else:
        fmt, items = open_pairs(data_path, skip_bad_records)
    if total is not None:  # a process per chunk at most: a small file is done before a pool starts
        workers = max(1, min(workers, -(-total // cache.CHUNK_ROWS)))
    rows = f"{total:,} " if total else ""
    say(f"tokenizing {rows}preference records into {folder} on {workers} process(es) (once per data, tokenizer, "
        "template, MAX_LENGTH and model kind)")
    pairs = build(folder, items, tok, fmt, max_length, workers, skip_bad_records, data_path or "the built-in pairs",
                  kind, rendering)
    took = time.perf_counter() - start
    rate = (len(pairs) + pairs.meta.n_skipped) / max(took, 1e-9)
    return pairs, f"preference cache: built {folder} in {took:.1f} s ({rate:,.0f} records/s)"
