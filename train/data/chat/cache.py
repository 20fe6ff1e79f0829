"""The chat library's one keyed cache engine, which SFT's conversations (conversation_cache.py) and the
preference pairs (pair_cache.py) are both kept on: keyed_cache makes the key (the data's bytes, the
tokenizer and its chat template, TEMPLATE, LOSS_ON, TRUNCATION, REASONING, MAX_LENGTH, SKIP_BAD_RECORDS and
the model's layout), drops a link at any of the cache's names, reuses a sound cache, says and rebuilds a
damaged one, and builds a missing one: the records stream in chunks to TOKENIZE_WORKERS processes
(encoded_chunks), the main process writes the results in record order, whatever the number of workers, into
a temporary folder, fsynced and renamed (build_into, write_files): a crash leaves no half cache. Each file is
checked against its sha256 once, then remembered in checked.json by size, mtime, ctime and inode
(open_files), so a warm start reads the files again only when they changed. CachedRows reads a folder's
rows back memory-mapped; each store says what a row is.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import numpy as np

from train.core.units import IGNORE_INDEX, cpu_cores
from train.data import cache_files, records, tokenize
from train.data.chat.formats import all_bad
from train.data.chat.templates import Rendering
from train.models.family import CAUSAL_LM

# 3: typed parts, TEMPLATE; 4: history, cuts keep the marker; 5: alpaca's "\n", cut eos; 6: unfit
SFT_CACHE_VERSION = "6"
CHUNK_ROWS = 512  # records per task: big enough to batch the tokenizer, small enough to keep workers even


# --- the engine: one keyed cache of tokenized records, whatever the records are ----------------------------


@dataclass(frozen=True)
class Store:
    """One kind of chat cache, as the engine sees it: its word in the log ("SFT cache: reused ..."), its
    folder under CACHE_DIR, every file name it may hold, how to open a folder of it, and how to build one."""

    label: str
    root: str
    names: tuple[str, ...]
    # (folder, verify=True, vocab=None) -> (cached, None) | (None, what's wrong) | (None, None)
    open: Callable
    build: Callable  # (folder, items, tok, fmt, max_length, workers, skip, total, data name, layout, ...)
    builtin_name: str  # the data's name in messages when DATA_PATH is empty


def keyed_cache(store: Store, data_path: str | None, builtin: list | None, opened: Callable[[], tuple], tok,
                max_length: int, skip_bad_records: bool, cache_dir: Path, workers: int, say, layout,
                rendering, key: Callable[[str], str] = str) -> tuple:
    """store's cache for this data (DATA_PATH, or `builtin` when it is None), tokenizer, rendering, MAX_LENGTH
    and layout: opened when there is one, else built from opened() -> (format, (place, record) items) on
    TOKENIZE_WORKERS processes. key: the data's key as this store keys it. Returns (cached, what was done)."""
    start = time.perf_counter()
    root = cache_dir / store.root
    cache_files.refuse_link(root, root / "sums")
    data_key, total = data_fingerprint(data_path, builtin, root / "sums")
    folder = root / cache_key(key(data_key), tok, max_length, skip_bad_records, layout.name, rendering)
    # A link at one of the cache's names is not a cache this kit wrote: removed, never read.
    cache_files.drop_link(folder, say)
    for name in [folder / "meta.json", *(folder / f for f in store.names)] if folder.is_dir() else []:
        cache_files.drop_link(name, say)
    cached, damage = store.open(folder, vocab=len(tok))
    if cached is not None:
        return cached, f"{store.label} cache: reused {folder} ({time.perf_counter() - start:.1f} s)"
    if damage:
        say(f"{store.label} cache {folder} was damaged ({damage}); rebuilding")
        cache_files.remove(folder)
    fmt, items = opened()
    if total is not None:  # a process per chunk at most: a small file is done before a pool starts
        workers = max(1, min(workers, -(-total // CHUNK_ROWS)))
    rows = f"{total:,} " if total else ""
    say(f"tokenizing {rows}{store.label} records into {folder} on {workers} process(es) (once per data, "
        "tokenizer, template, MAX_LENGTH and model kind)")
    cached = store.build(folder, items, tok, fmt, max_length, workers, skip_bad_records, total,
                         data_path or store.builtin_name, layout, rendering)
    took = time.perf_counter() - start
    rate = (len(cached) + cached.meta.n_skipped) / max(took, 1e-9)
    return cached, f"{store.label} cache: built {folder} in {took:.1f} s ({rate:,.0f} records/s)"


def build_into(store: Store, folder: Path, write: Callable[[Path], object], data_name: str, check=None):
    """Write store's cache into `folder`, atomically: write(tmp) fills a temporary folder beside it (fsynced)
    and returns the manifest, check(manifest) may refuse it, meta.json goes last, then the rename; another
    run that finished the same cache first wins, and its copy is used."""
    cache_files.remove_abandoned(cache_files.cache_folder(folder.parent))
    doing, cache = f"tokenizing the {store.label} data", f"the {store.label} cache"
    with cache_files.building(doing, cache, folder) as temps:
        tmp = cache_files.temp_folder(folder, temps)
        meta = write(tmp)
        if check is not None:
            check(meta)
        if meta.n == 0:
            raise all_bad(data_name, meta.n_skipped, meta.first_error)
        cache_files.publish(tmp, folder, meta.__dict__, temps, lambda f: store.open(f)[0] is not None)
    cached, damage = store.open(folder, verify=False)  # hashed as it was written
    if cached is None:
        raise OSError(f"the {store.label} cache just written does not read back ({damage})")
    return cached


def write_files(tmp: Path, names: tuple[str, ...], parts: Iterator[dict]) -> dict[str, str]:
    """Each {file name: array} of parts appended to tmp's files, fsynced; returns each file's sha256."""
    with contextlib.ExitStack() as stack:
        out = {name: cache_files.Hashed(stack.enter_context(open(tmp / name, "wb"))) for name in names}
        for arrays in parts:
            for name, array in arrays.items():
                out[name].write(array.tobytes())
        for handle in out.values():
            handle.flush()
            os.fsync(handle.fileno())
    return {name: handle.digest.hexdigest() for name, handle in out.items()}


def ids_dtype(tok):
    return np.uint16 if len(tok) <= 65535 else np.uint32


def manifest_of(cls) -> Callable[[dict], object]:
    """meta.json's dict -> cls (a Manifest), refused where its ids' type is not the kit's."""
    def parse(raw: dict):
        meta = cls(**{k: raw[k] for k in cls.__dataclass_fields__})
        if np.dtype(meta.dtype) not in (np.dtype(np.uint16), np.dtype(np.uint32)):  # unsigned: no id below 0
            raise ValueError(f"ids of type {meta.dtype}, not the kit's uint16 / uint32")
        return meta

    return parse


def open_files(folder: Path, what: str, parse, names_of, rows_bytes: Callable, vocab: int | None,
               verify: bool):
    """(manifest, None) for a folder whose files are sound: meta.json read, each file the size it says
    (rows_bytes(meta): the per-row files' sizes), ids.bin's ids within vocab, the sha256 checked once;
    (None, what is wrong) for a damaged one; (None, None) when there is none."""
    if not folder.exists():
        return None, None
    read, why = cache_files.read_manifest(folder, what, parse, names_of)
    if read is None:
        return None, why
    meta, sizes = read
    dtype = np.dtype(meta.dtype)
    expected = {"ids.bin": meta.n_tokens * dtype.itemsize, "trained.bin": meta.n_tokens, **rows_bytes(meta)}
    for name, size in expected.items():
        if sizes[name] != size:
            return None, f"{name} holds {sizes[name]:,} bytes, meta.json says {size:,}"

    def in_vocab(name: str) -> str | None:
        top = (
            int(np.memmap(folder / name, dtype=dtype, mode="r").max())
            if name == "ids.bin" and sizes[name]
            else -1
        )
        return (
            f"ids.bin holds id {top}, outside the tokenizer's {vocab} ids" if vocab and top >= vocab else None
        )

    damage = cache_files.verify_sums(folder, meta.sha256, names_of(meta), in_vocab) if verify else None
    return (None, damage) if damage else (meta, None)


class CachedRows:
    """Rows lo..hi of a cache folder (ids.bin and trained.bin, row after row), read from the memmaps on
    demand. A slice is another view of the same files, so a validation split copies nothing; it pickles
    as its file names (the DataLoader's workers map the files themselves instead of receiving every
    token). A subclass says each row's tokens (_row_tokens), makes a view (_view) and an example
    (_example)."""

    item = "row"

    def __init__(self, folder: Path, meta, lo: int = 0, hi: int | None = None):
        self.folder, self.meta = Path(folder), meta
        self.lo, self.hi = lo, meta.n if hi is None else hi
        self._offsets = self._ids = self._trained = None

    def __len__(self) -> int:
        return self.hi - self.lo

    def _open(self) -> None:
        self._offsets = np.concatenate([[0], np.cumsum(self._row_tokens(), dtype=np.int64)])
        shape, dtype = (self.meta.n_tokens,), np.dtype(self.meta.dtype)
        self._ids = np.memmap(self.folder / "ids.bin", dtype=dtype, mode="r", shape=shape)
        self._trained = np.memmap(self.folder / "trained.bin", dtype=np.uint8, mode="r", shape=shape)

    def __getitem__(self, index):
        if isinstance(index, slice):
            lo, hi, step = index.indices(len(self))
            if step != 1:
                raise ValueError(f"cached {self.item}s slice with step 1 only")
            return self._view(self.lo + lo, self.lo + max(lo, hi))
        if not -len(self) <= index < len(self):
            raise IndexError(f"{self.item} {index} of {len(self)}")
        if self._ids is None:
            self._open()
        k = self.lo + index % len(self)
        return self._example(k, int(self._offsets[k]), int(self._offsets[k + 1]))

    def _tokens(self, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, labels) of tokens start..end: labels -100 where trained.bin says the loss does not count."""
        ids = np.asarray(self._ids[start:end], dtype=np.int64)
        return ids, np.where(self._trained[start:end] != 0, ids, IGNORE_INDEX)

    def __getstate__(self):
        return {**self.__dict__, "_ids": None, "_trained": None, "_offsets": None}


def data_fingerprint(
    data_path: str | None, builtin: list | None, sums: Path | None = None
) -> tuple[str, int | None]:
    """(sha256 of the data, rows expected or None): DATA_PATH's file names and bytes (every
    file of an Arrow folder), or the built-in conversations themselves. The row count comes
    with the same read (newlines of JSONL, parquet metadata) and only feeds the progress bar.
    sums: a folder where each file's digest is kept under its path, size, mtime and inode, so
    a warm start does not read a GB of data again to find the cache it already has."""
    digest = hashlib.sha256(f"sft-data-{SFT_CACHE_VERSION}".encode())
    if data_path is None:
        digest.update(json.dumps(builtin, sort_keys=True).encode())
        return digest.hexdigest()[:20], len(builtin)
    rows: int | None = 0
    for source in records.source_files(data_path):
        files = sorted(p for p in source.rglob("*") if p.is_file()) if source.is_dir() else [source]
        lines = 0
        for path in files:
            file_sum, file_lines = cache_files.file_digest(path, sums)
            digest.update(f"{path.relative_to(source.parent)}\0{file_sum}\0".encode())
            lines += file_lines
        rows = None if rows is None else _rows(source, lines, rows)
    return digest.hexdigest()[:20], rows


def _rows(source: Path, lines: int, so_far: int) -> int | None:
    name = source.name.lower()
    if name.endswith(".jsonl"):
        return so_far + lines
    if name.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq

            return so_far + pq.ParquetFile(source).metadata.num_rows
        except Exception:  # a bad file: the reader will say so with its place
            return None
    return None  # .json lists, .gz, Arrow: the bar shows a rate without an end


def cache_key(data_key: str, tok, max_length: int, skip_bad_records: bool, layout_name: str = "causal",
              rendering: Rendering | None = None) -> str:
    from train.data.text import tokenizer_fingerprint

    parts = [SFT_CACHE_VERSION, data_key, tokenizer_fingerprint(tok), str(tok.chat_template), str(max_length),
             str(bool(skip_bad_records)), layout_name, (rendering or Rendering()).key()]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]


# --- the build: chunks of records -> worker processes -> files, in record order ----------------

_WORKER: tuple = ()


def _init_worker(
    tok, fmt: str, max_length: int, layout, rendering: Rendering, pool_worker: bool = True
) -> None:
    global _WORKER
    _WORKER = (tok, fmt, max_length, layout, rendering)
    if pool_worker:
        # A forked worker inherits the parent's handlers (the cache build's SIGTERM -> Interrupted,
        # the loop's "stop after this step"): with those, the SIGTERM that ends a broken pool would not end
        # it and the parent would wait forever. Ctrl+C is the parent's to handle; it ends the pool.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _chunks(items: Iterator, size: int) -> Iterator[list]:
    items = iter(items)
    while chunk := list(islice(items, size)):
        yield chunk


def encoded_chunks(items: Iterator, encode, tok, fmt: str, max_length: int, workers: int, layout=CAUSAL_LM,
                   rendering: Rendering | None = None) -> Iterator[tuple]:
    """encode(chunk)'s results per chunk of (place, record) items, in order; encode reads the tokenizer,
    format, MAX_LENGTH, layout and rendering from _WORKER. workers > 1: that many processes, at most two
    chunks each in flight: memory stays flat however long the data."""
    chunks, rendering = _chunks(items, CHUNK_ROWS), rendering or Rendering()
    if workers <= 1:
        _init_worker(tok, fmt, max_length, layout, rendering, pool_worker=False)
        yield from map(encode, chunks)
        return
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    # Set while the workers are forked (at the first chunk handed out), so they fork single-threaded.
    with tokenize.single_threaded_tokenizers():
        pool = tokenize.workers_pool(
            workers, context, _init_worker, (tok, fmt, max_length, layout, rendering)
        )
        try:
            tagged = ((None, chunk) for chunk in chunks)
            yield from (result for _, result in tokenize.in_order(pool, encode, tagged, 2 * workers))
        finally:
            tokenize.close_pool(pool)




def tokenize_workers(d) -> int:
    """TOKENIZE_WORKERS, or every core this process may run on."""
    if d.tokenize_workers is not None:
        return d.tokenize_workers
    return cpu_cores()
