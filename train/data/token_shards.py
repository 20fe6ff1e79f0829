"""The token cache: the corpus as token ids in shards on disk, built once, read as one stream.

Layout: CACHE_DIR/tokens/<data key>-<tokenizer key>/ holds shard-00000.bin, shard-00001.bin ...
(raw ids, uint16 or uint32) and manifest.json, which lists each finished shard with its token
count, largest id, sha256 of its bytes and the source units it came from. A shard is written under a
temporary name, fsynced and renamed, and only then entered in the manifest: Ctrl+C, SIGKILL or
a full disk after some shards keeps them, and the next run continues after the last one. The
units are a pure function of the files, so a resumed cache is byte for byte the one an
uninterrupted build makes, and a damaged shard (wrong size, ids out of the vocabulary, or bytes
whose sha256 is not the manifest's: a shard reversed in place keeps its size, max and sum) is
rebuilt alone. A shard checked once is
remembered in checked.json by size, mtime, ctime, inode and its whole manifest entry, so later
starts do not read the whole cache again (a shard changed since, even with its mtime put back,
is checked again; one written in the last seconds always is, as its times may not have moved
yet). The manifest is trusted only for what is checked: every shard name in it must be the
name the build gives that shard (shard-00003.bin, nothing with a folder in it) before anything
is opened, written or renamed, or the whole cache is rebuilt. One process at a time
builds in a CACHE_DIR (a lock on the tokens folder): under torchrun the first rank of a machine
to get there builds, the others wait, then all map the same files.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import numpy as np

from train.core import files
from train.core.errors import Interrupted, UsageError
from train.data import cache_files, tokenize

MANIFEST = "manifest.json"
CHECKED = cache_files.CHECKED  # a shard is remembered as settled by cache_files.SETTLED_NS (git's racy rule)
FORMAT = 3  # 3: a sha256 per shard (2 had a sum of ids, which a reordered shard keeps)
# Source bytes per shard: what an interruption can cost, and the granularity of a repair.
SHARD_SIZE = 64 << 20
BLOCK_IDS = 16 << 20  # ids per block when a shard is checked: memory stays flat whatever the shard
locked = cache_files.locked  # one builder per CACHE_DIR folder (text.py's tokenizer shares it)


class TokenStream:
    """Shards read as one flat array of ids (memmaps, opened lazily: a pickled copy, what a
    DataLoader worker receives, holds only the file names)."""

    def __init__(self, paths: list[Path], counts: list[int], dtype):
        self.paths, self.counts, self.dtype = [str(p) for p in paths], list(counts), np.dtype(dtype)
        self.offsets = np.cumsum([0, *self.counts])
        self._maps: list[np.memmap] | None = None

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def nbytes(self) -> int:
        return len(self) * self.dtype.itemsize

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_maps": None}

    def maps(self) -> list[np.memmap]:
        if self._maps is None:
            self._maps = [
                np.memmap(p, dtype=self.dtype, mode="r", shape=(n,)) if n else np.zeros(0, self.dtype)
                for p, n in zip(self.paths, self.counts, strict=True)
            ]
        return self._maps

    def __getitem__(self, key: slice) -> np.ndarray:
        start, stop, step = key.indices(len(self)) if isinstance(key, slice) else (key, key + 1, 1)
        if step != 1:
            raise IndexError("TokenStream takes contiguous slices")
        first = int(np.searchsorted(self.offsets, start, side="right")) - 1
        parts = []
        for shard in range(max(first, 0), len(self.counts)):
            lo = int(self.offsets[shard])
            if lo >= stop:
                break
            parts.append(self.maps()[shard][max(start - lo, 0) : stop - lo])
        out = np.concatenate(parts) if len(parts) != 1 else parts[0]
        return out if isinstance(key, slice) else out[0]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return np.concatenate(self.maps()).astype(dtype or self.dtype, copy=False)


def _checked(folder: Path, entry: dict, dtype: np.dtype, vocab: int) -> str | None:
    """What is wrong with one finished shard, or None. Reads it once, in blocks: its largest id
    and the sha256 of its bytes (sha256 runs at ~1.4 GB/s on a 2-core EPYC with SHA extensions,
    twice blake2b's speed there; figures in docs/data.md)."""
    path = files.inside(folder, entry["file"])
    if path is None or "/" in entry["file"] or path.is_symlink() or not path.is_file():
        return f"{entry['file']} is missing (or not a plain file of the cache)"
    size, want = path.stat().st_size, entry["tokens"] * dtype.itemsize
    if size != want:
        return f"{path.name} holds {size:,} bytes, {MANIFEST} says {want:,}"
    ids = np.memmap(path, dtype=dtype, mode="r") if size else np.zeros(0, dtype)
    digest, top, step = hashlib.sha256(), -1, BLOCK_IDS
    for lo in range(0, len(ids), step):
        block = ids[lo : lo + step]
        top = max(top, int(block.max()))
        digest.update(memoryview(np.ascontiguousarray(block)).cast("B"))
    if top >= vocab:
        return f"{path.name} holds id {top}, outside the tokenizer's {vocab} ids"
    if top != entry["max"] or digest.hexdigest() != entry["sha256"]:
        return f"{path.name} does not hold the bytes {MANIFEST} describes (its sha256 differs)"
    return None


def _stamp(folder: Path, entry: dict, itemsize: int) -> tuple[list | None, bool]:
    """(what checked.json remembers of a shard, whether it is settled): size, mtime, ctime,
    inode and its manifest entry; None where the size alone shows the shard does not fit its
    entry (a manifest claiming more tokens than the file holds is never mapped)."""
    try:
        st = os.lstat(folder / entry["file"])
    except (OSError, ValueError):
        return None, False
    if st.st_size != entry["tokens"] * itemsize:
        return None, False
    fields = [entry[k] for k in ("tokens", "max", "sha256", "start", "end")]
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, *fields], cache_files.settled(st)


def _sound_entry(index: int, entry) -> bool:
    """A manifest entry as the build writes it: the index's own shard name (never a path, so
    nothing outside the folder is opened, written or renamed) and whole numbers in range."""
    def count(v) -> bool:
        return type(v) is int and v >= 0

    def place(v) -> bool:
        return isinstance(v, list) and len(v) == 2 and all(count(x) for x in v)

    def sha(v) -> bool:
        return isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v)

    return (
        isinstance(entry, dict)
        and entry.get("file") == f"shard-{index:05d}.bin"
        and count(entry.get("tokens"))
        and sha(entry.get("sha256"))
        and type(entry.get("max")) is int
        and entry["max"] >= -1
        and place(entry.get("start"))
        and place(entry.get("end"))
    )


def _read_checked(folder: Path) -> dict:
    """checked.json, or nothing remembered (missing, unreadable, a planted link: never followed)."""
    try:
        memo = json.loads(files.read_text(folder / CHECKED))
        return memo if isinstance(memo, dict) else {}
    except (OSError, ValueError, UsageError):
        return {}


def _read_manifest(folder: Path, dtype: np.dtype, vocab: int, n_files: int) -> tuple[dict | None, str | None]:
    path = folder / MANIFEST
    if not path.exists() or path.is_symlink():
        return None, (f"{MANIFEST} is missing" if any(folder.glob("shard-*.bin")) else None)
    try:
        manifest = json.loads(files.read_text(path))
        shards = manifest["shards"]
        ok = manifest["format"] == FORMAT and manifest["dtype"] == dtype.name and manifest["vocab"] == vocab
        ok = ok and isinstance(shards, list) and all(_sound_entry(i, e) for i, e in enumerate(shards))
        # Shards follow one another through the data, and a complete cache's count is theirs:
        # a manifest cut short (entries deleted) must not serve part of the corpus as the whole.
        ok = ok and all(e["start"] == (shards[i - 1]["end"] if i else [0, 0]) for i, e in enumerate(shards))
        ok = ok and (
            not manifest.get("complete") or manifest.get("n_tokens") == sum(e["tokens"] for e in shards)
        )
    except (ValueError, KeyError, TypeError, RecursionError) as err:
        return None, f"{MANIFEST} cannot be read: {cache_files.short(err)}"
    except OSError as err:
        raise UsageError(f"CACHE_DIR: cannot read the token cache {path}: {err.strerror or err}") from None
    if not ok or manifest.get("files") != n_files:
        return None, f"{MANIFEST} does not describe this token cache"
    return manifest, None


def token_cache(files: list[Path], key: str, tok, cache_dir: Path, say, text_field: str = "text",
                workers: int | None = None):  # fmt: skip
    """The corpus's token ids: built (or continued, or mended) once, then read through memmaps.
    One shard: a np.memmap; more: a TokenStream over them. key names the data and tokenizer."""
    parent = cache_files.cache_folder(cache_dir / "tokens")
    folder = parent / key
    dtype = np.dtype(np.uint16 if len(tok) <= 65535 else np.uint32)
    with locked(parent, "a token cache", say):
        # A link at one of the cache's names is not a cache this kit wrote: removed, never read.
        cache_files.drop_link(folder, say)
        for name in [folder / MANIFEST, *sorted(folder.glob("shard-*.bin"))] if folder.is_dir() else []:
            cache_files.drop_link(name, say)
        manifest, damage = _read_manifest(folder, dtype, len(tok), len(files))
        if damage:
            say(f"token cache {folder} was damaged ({damage}); rebuilding")
        try:
            manifest = _built(folder, manifest, files, text_field, tok, dtype, workers, say)
        except _Mismatch as err:
            say(f"token cache {folder} was damaged ({err}); rebuilding the whole cache")
            manifest = _built(folder, None, files, text_field, tok, dtype, workers, say)
    shards = manifest["shards"]
    paths = [folder / entry["file"] for entry in shards]
    if len(shards) == 1:
        return np.memmap(paths[0], dtype=dtype, mode="r", shape=(shards[0]["tokens"],))
    return TokenStream(paths, [entry["tokens"] for entry in shards], dtype)


class _Mismatch(Exception):
    """A shard rebuilt from the data is not the one its manifest entry describes: the entry
    was altered, so nothing else in that manifest is trusted."""


def _built(folder, manifest, sources, text_field, tok, dtype, workers, say) -> dict:
    """The manifest of a complete cache: damaged shards mended, missing ones written (None: a
    fresh cache)."""
    if manifest is None:
        cache_files.remove(folder)
        manifest = {
            "format": FORMAT,
            "dtype": dtype.name,
            "vocab": len(tok),
            "files": len(sources),
            "shards": [],
        }
    build = _Build(folder, manifest, sources, text_field, tok, dtype, workers, say)
    build.mend()
    if not manifest.get("complete"):
        build.finish()
    return manifest


class _ShardFile:
    """One shard being written: ids streamed to a fresh temporary name (never through a link),
    fsynced and renamed into place by `files.writing` when the shard is closed; on any failure
    the temporary file is removed."""

    def __init__(self, path: Path, start: list[int], stack: ExitStack):
        self.path, self.start = path, start
        self.out = stack.enter_context(files.writing(path))
        self.stack = stack
        self.tokens, self.max, self.digest = 0, -1, hashlib.sha256()

    def add(self, ids: np.ndarray) -> None:
        data = ids.tobytes()
        self.out.write(data)
        self.digest.update(data)  # ~0.07 s per 100 MB of ids, next to minutes of encoding them
        if len(ids):
            self.tokens += len(ids)
            self.max = max(self.max, int(ids.max()))

    def close(self, end: list[int]) -> dict:
        self.stack.close()  # fsync, rename, fsync the folder
        return {"file": self.path.name, "tokens": self.tokens, "max": self.max,
                "sha256": self.digest.hexdigest(), "start": self.start, "end": end}  # fmt: skip


class _Build:
    """Writes the shards a manifest lacks (continue) or has damaged (mend)."""

    def __init__(self, folder, manifest, sources, text_field, tok, dtype, workers, say):
        self.folder, self.manifest, self.files, self.field = folder, manifest, sources, text_field
        self.dtype, self.say = dtype, say
        self.source_bytes = sum(tokenize.source_size(p) for p in sources)
        wanted = tokenize.all_cores() if workers is None else workers
        self.workers = wanted if self.source_bytes >= tokenize.POOL_MIN_BYTES else 1
        if not hasattr(tok, "backend_tokenizer"):
            raise UsageError("TOKENIZER_PATH: the token cache needs a fast tokenizer (a folder with "
                             "tokenizer.json)")
        self.tokenizer_json = tok.backend_tokenizer.to_str()
        self.eos_id = tok.convert_tokens_to_ids(tok.eos_token)

    def encoder(self) -> tokenize.Encoder:
        return tokenize.Encoder(self.tokenizer_json, self.eos_id, self.dtype, self.workers, self.folder)

    def mend(self) -> None:
        """Rebuild, alone, each finished shard that is damaged. A shard unchanged since it was
        last checked (checked.json) is not read again."""
        memo = _read_checked(self.folder)
        before = dict(memo)
        memo = {e["file"]: memo.get(e["file"]) for e in self.manifest["shards"]}  # names the manifest checks
        for entry in self.manifest["shards"]:
            stamp, settled = _stamp(self.folder, entry, self.dtype.itemsize)
            if stamp is not None and memo.get(entry["file"]) == stamp:
                continue
            damage = _checked(self.folder, entry, self.dtype, self.manifest["vocab"])
            if damage is None:
                memo[entry["file"]] = stamp if settled else None
                continue
            memo.pop(entry["file"], None)
            path = self.folder / entry["file"]
            self.say(f"token cache shard {path} was damaged ({damage}); rebuilding it alone")
            with self.encoder() as encoder, self._guard(path), ExitStack() as stack:
                shard = _ShardFile(path, entry["start"], stack)
                units = tokenize.units_until(
                    tokenize.iter_units(self.files, self.field, tuple(entry["start"])), tuple(entry["end"])
                )
                for _, ids in encoder.map((None, unit) for _, unit, _ in units):
                    shard.add(ids)
                rebuilt = shard.close(entry["end"])
            if rebuilt != entry:
                raise _Mismatch(f"the rebuilt {path.name} differs from its {MANIFEST} entry")
        memo = {name: stamp for name, stamp in memo.items() if stamp is not None}
        if memo != before:
            cache_files.write_json(self.folder / CHECKED, memo)

    def finish(self) -> None:
        """Write the shards after the last finished one, then mark the cache complete."""
        shards = self.manifest["shards"]
        start = tuple(shards[-1]["end"]) if shards else (0, 0)
        if shards:
            self.say(f"continuing the token cache {self.folder} after its {len(shards)} finished shard(s)")
        self.say(f"tokenizing {len(self.files)} file(s) into the token cache (once per corpus and tokenizer; "
                 f"{self.workers} worker(s), TOKENIZE_WORKERS)")  # fmt: skip
        cache_files.cache_folder(self.folder)
        # a killed build's; we hold the lock
        for stray in [*self.folder.glob(".*.tmp"), *self.folder.glob("*.tmp*")]:
            files.remove(stray)
        began, before = time.perf_counter(), sum(s["tokens"] for s in shards)
        with self.encoder() as encoder, tokenize.Progress(self.source_bytes) as bar:
            units = tokenize.iter_units(self.files, self.field, start)
            # One stream of units across shards: nothing read ahead is encoded twice.
            results = encoder.map(((pos, n), unit) for pos, unit, n in units)
            while (entry := self._next_shard(results, start, bar)) is not None:
                start = tuple(entry["end"])
        self._complete(time.perf_counter() - began, sum(s["tokens"] for s in shards) - before)

    def _next_shard(self, results, start: tuple, bar) -> dict | None:
        """Fill the next shard from results (units from start on), close it and enter it in the
        manifest; None when no unit is left."""
        path = self.folder / f"shard-{len(self.manifest['shards']):05d}.bin"
        with self._guard(path) as temps, ExitStack() as stack:
            shard, size, end = None, 0, [len(self.files), 0]
            for (pos, n), ids in results:
                shard = shard or _ShardFile(path, list(start), stack)
                shard.add(ids)
                size += n
                bar.update(n, len(ids))
                if size >= SHARD_SIZE:  # shards close after whole units: the same cuts every time
                    end = [pos[0], pos[1] + 1]
                    break
            if shard is None:
                return None
            entry = shard.close(end)
            temps.append(path)  # a shard the manifest does not list would be of no use
            self.manifest["shards"].append(entry)
            cache_files.write_json(self.folder / MANIFEST, self.manifest)
            temps.remove(path)
        return entry

    def _complete(self, seconds: float, new_tokens: int) -> None:
        n_tokens = sum(s["tokens"] for s in self.manifest["shards"])
        if n_tokens <= len(self.files):
            cache_files.remove(self.folder)
            raise UsageError("DATA_PATH: the data holds no text to train on")
        self.manifest.update(complete=True, n_tokens=n_tokens)
        with self._guard(self.folder / MANIFEST):
            cache_files.write_json(self.folder / MANIFEST, self.manifest)
        rate = (f"{self.source_bytes / 1e6 / max(seconds, 1e-9):.1f} MB/s, "
                f"{new_tokens / max(seconds, 1e-9):,.0f} tokens/s")
        self.say(f"cached {n_tokens:,} tokens from {len(self.files)} file(s) in {self.folder} "
                 f"({len(self.manifest['shards'])} shard(s); {rate})")  # fmt: skip

    @contextmanager
    def _guard(self, path: Path) -> Iterator[list[Path]]:
        kept = len(self.manifest["shards"])
        keep = f"; {kept} finished shard(s) kept: the next run continues from there" if kept else ""
        try:
            with cache_files.building("building the token cache", "the token cache", path) as temps:
                yield temps
        except Interrupted as err:
            if not kept:
                self._drop_if_empty()
                raise
            raise Interrupted(f"interrupted while building the token cache{keep}", err.exit_code) from None
        except UsageError as err:
            if not kept:
                self._drop_if_empty()
            raise UsageError(f"{err}{keep}") from None

    def _drop_if_empty(self) -> None:
        """No shard kept: the folder goes, with the workers' tokenizer file (they have read it)."""
        if not self.folder.is_dir():
            return
        for stray in self.folder.glob(".tokenizer-*.tmp"):
            files.remove(stray)
        if not any(self.folder.iterdir()):
            self.folder.rmdir()
