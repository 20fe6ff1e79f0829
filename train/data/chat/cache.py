"""SFT conversations tokenized once, into CACHE_DIR/sft/<key>/, and read back memory-mapped.

Once every record was read into RAM and tokenized again on every rank (100k alpaca records: a minute and
1.5 GB before the first step). Now the first run writes
  ids.bin      every conversation's token ids, back to back (uint16, or uint32 for big vocabularies)
  trained.bin  one byte per token: 1 where the loss counts (assistant content), 0 elsewhere
  lengths.bin  tokens per conversation (int32)
  meta.json    the manifest, written last: counts, dtype, format, records skipped, truncated and
               unfit, and each file's sha256 (taken as it is written)
and every later run with the same key maps them at once. The key covers what changes the ids: the data's
bytes, the tokenizer (vocabulary, merges, added tokens), the chat template, TEMPLATE, LOSS_ON, TRUNCATION,
REASONING, MAX_LENGTH, SKIP_BAD_RECORDS and the model kind: for an encoder-decoder (T5, BART) an example is a
(source, target) pair (encode.encode_pairs), ids.bin holds the source then the target, trained.bin is 1 on
the target, and source_lengths.bin (int32) says where the target starts. Only lengths are held in RAM.

The build streams the records (formats) in chunks to TOKENIZE_WORKERS processes, which render, tokenize
and truncate; the main process writes the results in record order, whatever the number of workers, into a
temporary folder, fsynced and renamed: a crash leaves no half cache, and a damaged one (a file cut short, a
manifest missing) is noticed, said, and built again. Each file is checked against its sha256 once (trained.bin
zeroed, lengths.bin rewritten with its sum kept), then remembered in checked.json by size, mtime, ctime and
inode, so a warm start reads the files again only when they changed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import chain, islice
from pathlib import Path

import numpy as np

from train.core.errors import UsageError
from train.core.units import IGNORE_INDEX
from train.data import cache_files, records, tokenize
from train.data.chat.encode import Rendering, Tally, encode
from train.data.chat.formats import all_bad, converted, open_records, refuse_bad

SFT_CACHE_VERSION = "6"  # 3: typed parts, TEMPLATE; 4: history, cuts keep the marker; 5: alpaca's "\n", cut eos; 6: unfit
CHUNK_ROWS = 512  # records per task: big enough to batch the tokenizer, small enough to keep workers even
_FILES = ("ids.bin", "trained.bin", "lengths.bin")
SOURCE_LENGTHS = "source_lengths.bin"  # seq2seq caches only
FILES_OF = {"causal": _FILES, "seq2seq": (*_FILES, SOURCE_LENGTHS)}  # each model kind's files


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
    kind: str  # "causal" (conversations) or "seq2seq" ((source, target) pairs)
    sha256: dict  # file name -> the sha256 of its bytes


class CachedExamples:
    """The cached conversations lo..hi as a sequence of {"input_ids", "labels"} (lists, as
    encode_conversations gives them; for seq2seq the source and the target, as encode_pairs
    does), read from the memmaps on demand. A slice is another view
    of the same files, so a validation split copies nothing. Pickles as its file names (the
    DataLoader's workers map the files themselves instead of receiving every token)."""

    def __init__(self, folder: Path, meta: Manifest, lo: int = 0, hi: int | None = None, lengths=None, sources=None):
        self.folder, self.meta = Path(folder), meta
        self.lo, self.hi = lo, meta.n if hi is None else hi
        if lengths is None:
            lengths = np.fromfile(self.folder / "lengths.bin", dtype=np.int32)
        if sources is None and meta.kind == "seq2seq":
            sources = np.fromfile(self.folder / SOURCE_LENGTHS, dtype=np.int32)
        self._all_lengths, self._all_sources = lengths, sources
        self._offsets = None
        self._ids = self._trained = None

    @property
    def lengths(self) -> np.ndarray:
        return self._all_lengths[self.lo : self.hi]

    @property
    def source_lengths(self) -> np.ndarray | None:
        """Source tokens of each pair (seq2seq); None for conversations."""
        return None if self._all_sources is None else self._all_sources[self.lo : self.hi]

    def __len__(self) -> int:
        return self.hi - self.lo

    def _open(self) -> None:
        self._offsets = np.concatenate([[0], np.cumsum(self._all_lengths, dtype=np.int64)])
        n_tokens, dtype = self.meta.n_tokens, np.dtype(self.meta.dtype)
        self._ids = np.memmap(self.folder / "ids.bin", dtype=dtype, mode="r", shape=(n_tokens,))
        self._trained = np.memmap(self.folder / "trained.bin", dtype=np.uint8, mode="r", shape=(n_tokens,))

    def __getitem__(self, index):
        if isinstance(index, slice):
            lo, hi, step = index.indices(len(self))
            if step != 1:
                raise ValueError("cached examples slice with step 1 only")
            return CachedExamples(self.folder, self.meta, self.lo + lo, self.lo + max(lo, hi), self._all_lengths,
                                  self._all_sources)
        if not -len(self) <= index < len(self):
            raise IndexError(f"example {index} of {len(self)}")
        if self._ids is None:
            self._open()
        k = self.lo + index % len(self)
        start, end = int(self._offsets[k]), int(self._offsets[k + 1])
        ids = np.asarray(self._ids[start:end], dtype=np.int64)
        if self._all_sources is not None:  # a pair: the source, then the target (every token a label)
            cut = int(self._all_sources[k])
            return {"input_ids": ids[:cut].tolist(), "labels": ids[cut:].tolist()}
        labels = np.where(self._trained[start:end] != 0, ids, IGNORE_INDEX)
        return {"input_ids": ids.tolist(), "labels": labels.tolist()}

    def __getstate__(self):
        return {**self.__dict__, "_ids": None, "_trained": None, "_offsets": None}


def data_fingerprint(data_path: str | None, builtin: list | None, sums: Path | None = None) -> tuple[str, int | None]:
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


def cache_key(data_key: str, tok, max_length: int, skip_bad_records: bool, kind: str = "causal",
              rendering: Rendering | None = None) -> str:
    from train.data.text import tokenizer_fingerprint

    parts = [SFT_CACHE_VERSION, data_key, tokenizer_fingerprint(tok), str(tok.chat_template), str(max_length),
             str(bool(skip_bad_records)), kind, (rendering or Rendering()).key()]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]


def _manifest(raw: dict) -> Manifest:
    meta = Manifest(**{k: raw[k] for k in Manifest.__dataclass_fields__})
    if np.dtype(meta.dtype) not in (np.dtype(np.uint16), np.dtype(np.uint32)):  # unsigned: no id below 0
        raise ValueError(f"ids of type {meta.dtype}, not the kit's uint16 / uint32")
    return meta


def open_cache(folder: Path, verify: bool = True, vocab: int | None = None) -> tuple[CachedExamples | None, str | None]:
    """(examples, None) for a sound cache; (None, what is wrong) for a damaged one; (None, None)
    when there is none. verify: check the files' sha256, and ids.bin's ids against vocab, once
    (see the module doc): a meta.json rewritten to match poisoned files still meets the latter."""
    if not folder.exists():
        return None, None
    read, why = cache_files.read_manifest(folder, "the SFT cache", _manifest, lambda meta: FILES_OF[meta.kind])
    if read is None:
        return None, why
    meta, sizes = read
    dtype = np.dtype(meta.dtype)
    expected = {"ids.bin": meta.n_tokens * dtype.itemsize, "trained.bin": meta.n_tokens, "lengths.bin": meta.n * 4}
    if meta.kind == "seq2seq":
        expected[SOURCE_LENGTHS] = meta.n * 4
    for name, size in expected.items():
        if sizes[name] != size:
            return None, f"{name} holds {sizes[name]:,} bytes, meta.json says {size:,}"
    def in_vocab(name: str) -> str | None:
        top = int(np.memmap(folder / name, dtype=dtype, mode="r").max()) if name == "ids.bin" and sizes[name] else -1
        return f"ids.bin holds id {top}, outside the tokenizer's {vocab} ids" if vocab and top >= vocab else None

    damage = cache_files.verify_sums(folder, meta.sha256, FILES_OF[meta.kind], in_vocab) if verify else None
    if damage:
        return None, damage
    examples = CachedExamples(folder, meta)
    if int(examples.lengths.sum(dtype=np.int64)) != meta.n_tokens or (examples.lengths < 0).any():
        return None, "lengths.bin does not add up to the token count"
    sources = examples.source_lengths
    if sources is not None and not ((sources >= 0) & (sources <= examples.lengths)).all():
        return None, f"{SOURCE_LENGTHS} does not fit lengths.bin"
    return examples, None


# --- the build: chunks of records -> worker processes -> files, in record order ----------------

_WORKER: tuple = ()


def _init_worker(tok, fmt: str, max_length: int, kind: str, rendering: Rendering, pool_worker: bool = True) -> None:
    global _WORKER
    _WORKER = (tok, fmt, max_length, kind, rendering)
    if pool_worker:
        # A forked worker inherits the parent's handlers (the cache build's SIGTERM -> Interrupted,
        # the loop's "stop after this step"): with those, the SIGTERM that ends a broken pool would not end
        # it and the parent would wait forever. Ctrl+C is the parent's to handle; it ends the pool.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _encode_chunk(chunk: list[tuple[str, object]]):
    """A chunk of (place, record) -> (ids, trained, lengths, source lengths or None, (truncated, tools kept,
    unfit), bad); unfit and bad: "place: reason" of each such record."""
    tok, fmt, max_length, kind, rendering = _WORKER
    conversations, places, bad = [], [], []
    for place, record in chunk:  # one at a time: a conversation encode refuses is named by its place
        good, worse = converted([(place, record)], fmt)
        conversations += good  # in place: a new list per record made each chunk quadratic
        places += [place] * len(good)
        bad += worse
    tally = Tally()
    examples, n_cut = encode(conversations, tok, max_length, kind, rendering, tally)
    bad += [f"{places[i]}: {reason}" for i, reason in tally.refused]
    counts = (n_cut, tally.tools_kept, [f"{places[i]}: {reason}" for i, reason in tally.unfit])
    # A conversation's length, or a pair's source length (its input_ids are the source).
    firsts = np.fromiter((len(e["input_ids"]) for e in examples), dtype=np.int32, count=len(examples))
    if kind != "seq2seq":
        labels = np.fromiter(chain.from_iterable(e["labels"] for e in examples), dtype=np.int64, count=int(firsts.sum()))
        ids = np.fromiter(chain.from_iterable(e["input_ids"] for e in examples), dtype=np.int64, count=len(labels))
        return ids, (labels != IGNORE_INDEX).astype(np.uint8), firsts, None, counts, bad
    sources = firsts
    targets = np.fromiter((len(e["labels"]) for e in examples), dtype=np.int32, count=len(examples))
    lengths = sources + targets
    ids = np.fromiter(chain.from_iterable(chain(e["input_ids"], e["labels"]) for e in examples), dtype=np.int64,
                      count=int(lengths.sum()))
    flags = chain.from_iterable(chain([0] * len(e["input_ids"]), [1] * len(e["labels"])) for e in examples)
    trained = np.fromiter(flags, dtype=np.uint8, count=len(ids))
    return ids, trained, lengths, sources, counts, bad


def _chunks(items: Iterator, size: int) -> Iterator[list]:
    items = iter(items)
    while chunk := list(islice(items, size)):
        yield chunk


def encoded_chunks(items: Iterator, tok, fmt: str, max_length: int, workers: int, kind: str = "causal",
                   rendering: Rendering | None = None, encode=None) -> Iterator[tuple]:
    """encode's results (_encode_chunk's, or the preference cache's: it reads _WORKER too) per chunk, in order.
    workers > 1: that many processes, at most two chunks each in flight: memory stays flat however long the data."""
    chunks, rendering, encode = _chunks(items, CHUNK_ROWS), rendering or Rendering(), encode or _encode_chunk
    if workers <= 1:
        _init_worker(tok, fmt, max_length, kind, rendering, pool_worker=False)
        yield from map(encode, chunks)
        return
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    # Set while the workers are forked (at the first chunk handed out), so they fork single-threaded.
    with tokenize.single_threaded_tokenizers():
        pool = tokenize.workers_pool(workers, context, _init_worker, (tok, fmt, max_length, kind, rendering))
        try:
            tagged = ((None, chunk) for chunk in chunks)
            yield from (result for _, result in tokenize.in_order(pool, encode, tagged, 2 * workers))
        finally:
            tokenize.close_pool(pool)


def _progress(total: int | None):
    from tqdm import tqdm

    return tqdm(total=total, desc="tokenizing SFT data", unit=" rows", unit_scale=True, leave=False,
                disable=None, mininterval=1.0)


def _write(tmp: Path, items: Iterator, tok, fmt: str, max_length: int, workers: int, skip: bool,
           total: int | None, kind: str, rendering: Rendering | None = None) -> Manifest:
    """Tokenize every record into tmp's files (fsynced); returns the manifest's content."""
    dtype = np.uint16 if len(tok) <= 65535 else np.uint32
    n = n_tokens = n_skipped = n_truncated = n_tools_kept = n_unfit = 0
    first_error = first_unfit = ""
    with contextlib.ExitStack() as stack:
        out = {name: cache_files.Hashed(stack.enter_context(open(tmp / name, "wb"))) for name in FILES_OF[kind]}
        bar = stack.enter_context(_progress(total))
        chunks = encoded_chunks(items, tok, fmt, max_length, workers, kind, rendering)
        for ids, trained, lengths, sources, (truncated, tools_kept, unfit), bad in chunks:
            if bad and not skip:
                raise refuse_bad(bad[0])
            first_error, first_unfit = first_error or (bad or [""])[0], first_unfit or (unfit or [""])[0]
            out["ids.bin"].write(ids.astype(dtype).tobytes())
            out["trained.bin"].write(trained.tobytes())
            out["lengths.bin"].write(lengths.tobytes())
            if sources is not None:
                out[SOURCE_LENGTHS].write(sources.tobytes())
            n, n_tokens = n + len(lengths), n_tokens + len(ids)
            n_skipped, n_truncated, n_tools_kept = n_skipped + len(bad), n_truncated + truncated, n_tools_kept + tools_kept
            n_unfit += len(unfit)
            bar.update(len(lengths) + len(bad) + len(unfit))
        for handle in out.values():
            handle.flush()
            os.fsync(handle.fileno())
    sums = {name: handle.digest.hexdigest() for name, handle in out.items()}
    return Manifest(n, n_tokens, np.dtype(dtype).name, fmt, n_skipped, n_truncated, first_error, n_tools_kept,
                    n_unfit, first_unfit, kind, sums)


def build(folder: Path, items: Iterator, tok, fmt: str, max_length: int, workers: int, skip: bool,
          total: int | None, data_name: str, kind: str = "causal", rendering=None) -> CachedExamples:
    """Write the cache for `items` into `folder`, atomically: a temporary folder beside it,
    manifest last, fsynced, renamed."""
    cache_files.remove_abandoned(cache_files.cache_folder(folder.parent))
    with cache_files.building("tokenizing the SFT data", "the SFT cache", folder) as temps:
        tmp = cache_files.temp_folder(folder, temps)
        meta = _write(tmp, items, tok, fmt, max_length, workers, skip, total, kind, rendering)
        # A few records too long for this model are skipped; most, or all, stop the run, unless
        # SKIP_BAD_RECORDS=1 asked for the skip: then what fits trains (load_dataset says how much did not).
        if meta.n_unfit > meta.n and (not skip or meta.n == 0):
            hint = "" if skip else f" (SKIP_BAD_RECORDS=1 trains on the {meta.n} that fit)" if meta.n else ""
            raise UsageError(f"DATA_PATH: {data_name}: {meta.n_unfit} of {meta.n_unfit + meta.n} records cannot fit "
                             f"this model at MAX_LENGTH={max_length}{hint}; the first: {meta.first_unfit}")
        if meta.n == 0:
            raise all_bad(data_name, meta.n_skipped, meta.first_error)
        cache_files.publish(tmp, folder, meta.__dict__, temps, lambda f: open_cache(f)[0] is not None)
    examples, damage = open_cache(folder, verify=False)  # hashed as it was written
    if examples is None:
        raise OSError(f"the SFT cache just written does not read back ({damage})")
    return examples


def sft_cache(data_path: str | None, builtin: list | None, tok, max_length: int, skip_bad_records: bool,
              cache_dir: Path, workers: int, say, kind: str = "causal",
              rendering: Rendering | None = None, text_field: str = "text") -> tuple[CachedExamples, str]:
    """The SFT cache for this data, tokenizer, rendering (TEMPLATE, LOSS_ON ...), MAX_LENGTH and model
    kind ("causal" or "seq2seq"): opened when there is one, else built (TOKENIZE_WORKERS processes). Returns
    (examples, what was done, for the log)."""
    start = time.perf_counter()
    cache_files.refuse_link(cache_dir / "sft", cache_dir / "sft" / "sums")
    data_key, total = data_fingerprint(data_path, builtin, cache_dir / "sft" / "sums")
    data_key += f"\0text_field={text_field}" if text_field != "text" else ""  # what a plain-text record trains on
    folder = cache_dir / "sft" / cache_key(data_key, tok, max_length, skip_bad_records, kind, rendering)
    # A link at one of the cache's names is not a cache this kit wrote: removed, never read.
    cache_files.drop_link(folder, say)
    for name in [folder / "meta.json", *(folder / f for f in FILES_OF["seq2seq"])] if folder.is_dir() else []:
        cache_files.drop_link(name, say)
    examples, damage = open_cache(folder, vocab=len(tok))
    if examples is not None:
        return examples, f"SFT cache: reused {folder} ({time.perf_counter() - start:.1f} s)"
    if damage:
        say(f"SFT cache {folder} was damaged ({damage}); rebuilding")
        cache_files.remove(folder)
    if data_path is None:
        fmt, items = "messages", ((f"built-in pair {i}", {"messages": c}) for i, c in enumerate(builtin, 1))
    else:
        fmt, items = open_records(data_path, text_field, skip_bad_records)
    if total is not None:  # a process per chunk at most: a small file is done before a pool starts
        workers = max(1, min(workers, -(-total // CHUNK_ROWS)))
    rows = f"{total:,} " if total else ""
    say(f"tokenizing {rows}SFT records into {folder} on {workers} process(es) (once per data, tokenizer, "
        "template, MAX_LENGTH and model kind)")
    examples = build(folder, items, tok, fmt, max_length, workers, skip_bad_records, total, data_path or "built-in",
                     kind, rendering)
    took = time.perf_counter() - start
    rate = (len(examples) + examples.meta.n_skipped) / max(took, 1e-9)
    return examples, f"SFT cache: built {folder} in {took:.1f} s ({rate:,.0f} records/s)"
