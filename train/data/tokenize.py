"""Sources -> token ids on every core: the corpus cut into work units, encoded in worker processes.

The main process only reads: it cuts each source into units of about a megabyte (whole JSONL
lines as raw bytes, a run of Arrow text arrays, or pieces of a text file) and hands them to
TOKENIZE_WORKERS processes, which parse, encode with the tokenizer's own encode_batch (one
thread each: the processes are the parallelism) and return the ids with the end-of-text id
after each document. Units come back in order, at most a few per worker in flight, so memory
stays flat whatever the corpus size. The units are a pure function of the files, which is what
lets a cache be built in shards, resumed and mended shard by shard with the same bytes.
The chat encoder's segments go through encode_texts here too: one batch call, a huge one by its ends.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import os
import signal
import tempfile
import time
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np

from train.core import units
from train.core.errors import UsageError
from train.data import records

# Characters (text) or bytes (JSONL, Arrow) per unit: enough for encode_batch to be efficient
# and for pickling to cost nothing next to encoding (~0.2 s of one core per unit).
UNIT_SIZE = 1 << 20
# Below this many source bytes the pool's start-up (~0.5 s) costs more than it saves.
POOL_MIN_BYTES = 8 << 20
IN_FLIGHT_PER_WORKER = 2


def all_cores() -> int:
    return units.cpu_cores()


def _columns(path: Path, field: str) -> Iterator[tuple[list, int, int]]:
    """The TEXT_FIELD column of a parquet/Arrow source as (arrays, bytes, first row) of about
    UNIT_SIZE; the row (1-based) lets a worker name the row of a string that is not UTF-8."""
    import pyarrow as pa

    arrays, size, first, row = [], 0, 1, 1
    for batch in records.record_batches(path, [field]):
        column = batch.column(0)
        records.text_column(path, batch.slice(0, 0), field)  # the type check, on no rows
        if pa.types.is_dictionary(column.type):  # pandas "category": the texts themselves
            column = column.dictionary_decode()
        # A batch may be a slice of a whole decoded row group, and a slice pickles with its
        # parent's buffers (120 MB for 1 MB of text): a compact copy goes to the worker.
        arrays.append(
            pa.concat_arrays([column])
            if column.offset or column.get_total_buffer_size() > 2 * column.nbytes
            else column
        )
        size += column.nbytes
        row += len(column)
        if size >= UNIT_SIZE:
            yield arrays, size, first
            arrays, size, first = [], 0, row
    if arrays:
        yield arrays, size, first


def _grouped(pieces: Iterable[str]) -> Iterator[tuple[list[str], int]]:
    unit, size = [], 0
    for piece in pieces:
        unit.append(piece)
        size += len(piece)
        if size >= UNIT_SIZE:
            yield unit, size
            unit, size = [], 0
    if unit:
        yield unit, size


def file_units(path: Path, field: str) -> Iterator[tuple[tuple, int]]:
    """(unit, size) for one source. A unit is picklable and names its own kind."""
    suffix = records.suffix_of(path)
    if records.is_text_file(path) or suffix == records.JSON_SUFFIX:
        for pieces, size in _grouped(records.iter_texts(path, field)):
            yield ("pieces", pieces), size
    elif path.is_dir() or suffix in (".parquet", ".arrow"):
        for arrays, size, first_row in _columns(path, field):
            yield ("column", str(path), arrays, field, first_row), size
    else:
        for first_line, block in records.jsonl_blocks(path, UNIT_SIZE):
            yield ("jsonl", str(path), first_line, block, field), len(block)


def iter_units(
    files: list[Path], field: str, start: tuple[int, int] = (0, 0)
) -> Iterator[tuple[tuple, tuple, int]]:
    """((file index, unit index), unit, size) for every unit of the corpus from `start` on.
    Units before it are read but not returned (cheap next to encoding them)."""
    for file_index, path in enumerate(files):
        if file_index < start[0]:
            continue
        for unit_index, (unit, size) in enumerate(file_units(path, field)):
            if (file_index, unit_index) >= start:
                yield (file_index, unit_index), unit, size


def units_until(units, end: tuple | None):
    """iter_units' units before the position `end` (None: all of them)."""
    for pos, unit, n in units:
        if end is not None and pos >= end:
            return
        yield pos, unit, n


def source_size(path: Path) -> int:
    """Bytes of a source on disk (an Arrow folder: its .arrow files)."""
    if path.is_dir():
        return sum(p.stat().st_size for p in path.glob("*.arrow"))
    return path.stat().st_size


def unit_pieces(unit: tuple) -> list[str]:
    """A unit's texts as pieces, "" after each document's last piece (records.iter_texts' form)."""
    kind = unit[0]
    if kind == "pieces":
        return unit[1]
    pieces: list[str] = []
    if kind == "column":
        _, path, arrays, field, row = unit
        for array in arrays:
            for doc in records.as_python(Path(path), array, row):
                if doc is not None:
                    pieces += records.split_document(doc)
                    pieces.append("")
            row += len(array)
        return pieces
    _, path, first_line, block, field = unit
    for where, record in records.parse_jsonl_block(Path(path), first_line, block):
        pieces += records.split_document(records.record_text(Path(path), where, record, field))
        pieces.append("")
    return pieces


def encode_pieces(backend, pieces: list[str], eos_id: int, dtype: np.dtype) -> np.ndarray:
    """The ids of the pieces in one encode_batch, the end-of-text id where a document ends."""
    texts = [p for p in pieces if p]
    encoded = iter(backend.encode_batch(texts, add_special_tokens=False) if texts else ())
    ids = ((eos_id,) if not p else next(encoded).ids for p in pieces)
    return np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype)


def encode_texts(tokenizer, pieces: list[str]) -> list[list[int]]:
    """Token ids of each piece, no special tokens added: the same ids as tokenizer(pieces), but
    straight from the Rust tokenizer where there is one, without transformers turning every
    encoding into a dict of lists (a quarter of the tokenizing time in a profile)."""
    if not pieces:
        return []
    backend = getattr(tokenizer, "backend_tokenizer", None)
    encode = getattr(backend, "encode_batch_fast", None) or getattr(backend, "encode_batch", None)
    if encode is None:
        return tokenizer(pieces, add_special_tokens=False)["input_ids"]
    return [e.ids for e in encode(pieces, add_special_tokens=False)]


_EDGE = 64  # tokens past what a cut keeps at a cut end (may differ from the whole piece's): dropped


def encode_texts_bounded(tokenizer, pieces: list[str], max_length: int) -> list[list[int]]:
    """encode_texts, a piece too long for max_length encoded by its two ends: every cut keeps at
    most max_length tokens of a piece, from its start or end, so (max_length + _EDGE) tokens of each
    end give the same example. Whole, each token cost ~235 bytes in the tokenizer (a 60 MB reasoning
    part: 6.5 GB, then SIGABRT). Long: over 16 characters a token; ends read at 8, more if too few."""
    need = max_length + _EDGE
    long = {i for i, piece in enumerate(pieces) if len(piece) > 16 * need}
    ids = encode_texts(tokenizer, ["" if i in long else piece for i, piece in enumerate(pieces)])
    for i in long:
        ids[i] = _ends(tokenizer, pieces[i], need)
    return ids


def _ends(tokenizer, text: str, need: int) -> list[int]:
    chars = 8 * need
    while 2 * chars < len(text):
        head, tail = encode_texts(tokenizer, [text[:chars], text[-chars:]])
        if len(head) >= need + _EDGE and len(tail) >= need + _EDGE:
            return list(head[:need]) + list(tail[-need:])
        chars *= 4
    return list(encode_texts(tokenizer, [text])[0])


_WORKER: dict = {}


def _start_worker(tokenizer_file: str, eos_id: int, dtype: str) -> None:
    # One thread per process: the processes are the parallelism (set before the first encode).
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C is the main process's to handle
    try:
        text = Path(tokenizer_file).read_text(encoding="utf-8")
    except FileNotFoundError:  # the main process is stopping (Ctrl+C, SIGTERM) and removed it: end quietly
        os._exit(1)
    backend = backend_of_json(text)
    _WORKER.update(backend=backend, eos=eos_id, dtype=np.dtype(dtype))


def backend_of_json(tokenizer_json: str):
    from tokenizers import Tokenizer

    backend = Tokenizer.from_str(tokenizer_json)
    backend.no_truncation()  # as the transformers wrapper calls it: every token, no padding
    backend.no_padding()
    return backend


def _encode_unit(unit: tuple) -> np.ndarray:
    return encode_pieces(_WORKER["backend"], unit_pieces(unit), _WORKER["eos"], _WORKER["dtype"])


# What a worker's death means for the user: the OOM killer is what ends a tokenizing worker on a
# full machine, and Pool.apply_async's result would then be awaited forever (Pool replaces a dead
# worker and loses its task); ProcessPoolExecutor says the pool broke instead.
WORKER_DIED = ("TOKENIZE_WORKERS: a tokenizing worker process was killed (SIGKILL; on a full machine the "
               "out-of-memory killer), so the data could not all be tokenized; run again with fewer "
               "TOKENIZE_WORKERS (or a lower MAX_RECORD_MB)")


@contextlib.contextmanager
def single_threaded_tokenizers():
    # Each worker is one core already; the Rust tokenizer's own threads would only contend (and
    # after a fork it turns them off anyway, with a warning, unless this variable is set).
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


def workers_pool(workers: int, context, initializer, initargs: tuple) -> ProcessPoolExecutor:
    return ProcessPoolExecutor(workers, mp_context=context, initializer=initializer, initargs=initargs)


def in_order(
    pool: ProcessPoolExecutor, fn, items: Iterable[tuple[object, object]], limit: int
) -> Iterator[tuple]:
    """(tag, fn(arg)) for each (tag, arg) of items, in order, at most `limit` in flight (memory
    stays flat). A worker that dies fails the run in one line (WORKER_DIED), never a hang."""
    pending: deque = deque()
    try:
        for tag, arg in items:
            pending.append((tag, pool.submit(fn, arg)))
            if len(pending) >= limit:
                tag, result = pending.popleft()
                yield tag, result.result()
        while pending:
            tag, result = pending.popleft()
            yield tag, result.result()
    except BrokenProcessPool:
        raise UsageError(WORKER_DIED) from None


def close_pool(pool: ProcessPoolExecutor) -> None:
    """No new work; the running tasks end (a unit or chunk each: under a second), then the processes."""
    pool.shutdown(wait=True, cancel_futures=True)


class Encoder:
    """Encodes units in order, in `workers` processes (or in this one for small corpora or one
    worker). A context manager: the processes end with it, whatever happened."""

    def __init__(
        self, tokenizer_json: str, eos_id: int, dtype: np.dtype, workers: int, temp_dir: Path | None = None
    ):
        self.args = (tokenizer_json, eos_id, np.dtype(dtype).name)
        self.workers = workers
        self.temp_dir = temp_dir  # the cache folder, whose *.tmp strays a later build sweeps (a SIGKILL's)
        self.pool = None

    def __enter__(self) -> Encoder:
        if self.workers > 1:
            # The tokenizer reaches the workers as a file they read, not as an argument: spawn
            # writes a process's arguments into a pipe the new process reads only once its
            # interpreter is up, so a 0.5-10 MB tokenizer made each start wait for the last
            # (16 workers: 5.7 s before the first unit, measured on a 16-core host).
            fd, self.tokenizer_file = tempfile.mkstemp(prefix=".tokenizer-", suffix=".tmp", dir=self.temp_dir)
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as out:
                    out.write(self.args[0])
                # spawn: lean workers (no copy of torch), and no fork of a process with threads.
                context = multiprocessing.get_context("spawn")
                self.pool = workers_pool(
                    self.workers, context, _start_worker, (self.tokenizer_file, *self.args[1:])
                )
            except BaseException:  # no pool (too many files, Ctrl+C while starting): no file left
                Path(self.tokenizer_file).unlink(missing_ok=True)
                raise
        else:
            self.backend = backend_of_json(self.args[0])
        return self

    def __exit__(self, *exc) -> None:
        if self.pool is not None:
            close_pool(self.pool)
            Path(self.tokenizer_file).unlink(missing_ok=True)

    def map(self, items: Iterable[tuple[object, tuple]]) -> Iterator[tuple[object, np.ndarray]]:
        """(tag, ids) for each (tag, unit), in order; `items` is read only a few units ahead."""
        if self.pool is None:
            for tag, unit in items:
                yield (
                    tag,
                    encode_pieces(self.backend, unit_pieces(unit), self.args[1], np.dtype(self.args[2])),
                )
            return
        yield from in_order(self.pool, _encode_unit, items, self.workers * IN_FLIGHT_PER_WORKER)


class Progress:
    """tqdm on stderr over the source bytes: MB/s, tokens/s and an ETA."""

    def __init__(self, total: int):
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc="tokenizing", unit="B", unit_scale=True, unit_divisor=1 << 20,
                        leave=False, disable=None, smoothing=0.1)  # fmt: skip
        self.tokens, self.began = 0, time.perf_counter()

    def __enter__(self) -> Progress:
        return self

    def update(self, n_bytes: int, n_tokens: int) -> None:
        self.tokens += n_tokens
        self.bar.update(min(n_bytes, max(self.bar.total - self.bar.n, 0)))
        rate = self.tokens / max(time.perf_counter() - self.began, 1e-9)
        self.bar.set_postfix_str(f"{rate:,.0f} tokens/s", refresh=False)

    def __exit__(self, *exc) -> None:
        self.bar.close()
