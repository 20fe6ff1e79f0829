"""Text -> tokenizer -> token cache on disk (memmap) -> packed Dataset -> DataLoader.

The token cache is keyed by the data's content and the tokenizer, so a second run starts at
once, and workers read the same memmap pages instead of each holding a copy.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from train.core.errors import UsageError
from train.core.remote_code import refuse_custom_code
from train.data import cache_files

EOS = "<|endoftext|>"
CACHE_VERSION = "1"
# Standard-library folders left out of the built-in corpus: tests are huge and repetitive.
_SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "lib2to3", "__pycache__", "turtledemo", "tkinter"}
_CHUNK_CHARS = 1 << 16


def builtin_corpus_files() -> list[Path]:
    """The running Python's standard-library sources: text on every machine with Python."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("."))
        found += [Path(folder) / f for f in sorted(files) if f.endswith(".py")]
    return found


def corpus_files(data_path: str | None) -> list[Path]:
    """The files to train on: DATA_PATH (file or folder of .txt/.jsonl) or the built-in corpus."""
    if data_path is None:
        return builtin_corpus_files()
    path = Path(data_path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in (".txt", ".jsonl", ".md"))
        if not files:
            raise UsageError(f"DATA_PATH: folder {path} holds no .txt, .md or .jsonl files")
        return files
    return [path]


def read_documents(path: Path) -> Iterator[str]:
    """The documents of one file: the whole text of a .txt, or each "text" field of a .jsonl."""
    try:
        raw = path.read_bytes()
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UsageError(f"DATA_PATH: {path} is not UTF-8 text (bad byte at offset {err.start})") from None
    except OSError as err:
        raise UsageError(f"DATA_PATH: cannot read {path}: {err.strerror}") from None
    if path.suffix != ".jsonl":
        yield text
        return
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise UsageError(f"DATA_PATH: {path} line {number}: not valid JSON ({err.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise UsageError(f'DATA_PATH: {path} line {number}: expected an object with a "text" string')
        yield record["text"]


def corpus_fingerprint(files: list[Path]) -> str:
    """sha256 of every file's name and bytes: the cache key for the data."""
    digest = hashlib.sha256(CACHE_VERSION.encode())
    for path in files:
        digest.update(path.name.encode() + b"\0")
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:20]


def iter_chunks(files: list[Path]) -> Iterator[str]:
    """Documents cut at line ends into pieces of ~64K characters, each document ending with
    the end-of-text token, so the tokenizer can work on them in parallel."""
    for path in files:
        for doc in read_documents(path):
            start = 0
            while start < len(doc):
                end = doc.find("\n", start + _CHUNK_CHARS)
                end = len(doc) if end == -1 else end + 1
                yield doc[start:end]
                start = end
            yield EOS


def load_tokenizer(tokenizer_path: str | None, files: list[Path], key: str, vocab_size: int, cache_dir: Path, say):
    """A local AutoTokenizer folder, or a byte-level BPE trained on the corpus and cached."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if tokenizer_path is not None:
        # Pretraining has no TRUST_REMOTE_CODE: a tokenizer folder never runs its own code here.
        refuse_custom_code(tokenizer_path, "TOKENIZER_PATH")
        try:
            tok = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True, trust_remote_code=False)
        except (OSError, ValueError) as err:
            raise UsageError(f"TOKENIZER_PATH: cannot load a tokenizer from {tokenizer_path}: {err}") from None
        if tok.eos_token is None:
            tok.add_special_tokens({"eos_token": EOS})
        return tok
    folder = cache_dir / "tokenizers" / f"bpe-{vocab_size}-{key}"
    cache_files.drop_link(folder, say)
    if folder.exists():
        try:
            return PreTrainedTokenizerFast.from_pretrained(folder, local_files_only=True)
        except Exception as err:  # a cut or missing file (the library raises several kinds)
            say(f"tokenizer cache {folder} was damaged ({cache_files.short(err)}); rebuilding")
            cache_files.remove(folder)
            if folder.exists():
                raise UsageError(f"CACHE_DIR: cannot remove the damaged tokenizer cache {folder}") from None
    # Before the training, not after: an unusable CACHE_DIR stops the run before minutes of work.
    cache_files.cache_folder(folder.parent)
    with cache_files.building("training the tokenizer", "the tokenizer", folder) as temps:
        tok = _train_tokenizer(files, vocab_size, say)
        if not cache_files.save_folder(folder, tok.save_pretrained, temps):
            # Another run on the same corpus (same key) saved it first: use that one, so every
            # run of this corpus tokenizes with the same files.
            return PreTrainedTokenizerFast.from_pretrained(folder, local_files_only=True)
    return tok


def _train_tokenizer(files: list[Path], vocab_size: int, say):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    say(f"training a byte-level BPE tokenizer (vocab {vocab_size}) on the corpus; cached for next time")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator((c for c in iter_chunks(files) if c != EOS), trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, bos_token=EOS, unk_token=None)
    tok.pad_token = EOS
    return tok


def tokenizer_fingerprint(tok) -> str:
    state = tok.backend_tokenizer.to_str() if hasattr(tok, "backend_tokenizer") else repr(tok.get_vocab())
    return hashlib.sha256(state.encode()).hexdigest()[:20]


def token_cache(files: list[Path], data_key: str, tok, cache_dir: Path, say) -> np.ndarray:
    """The corpus as one flat array of token ids on disk, opened as a read-only memmap.

    The .json beside the .bin is its manifest (token count, dtype, byte size), written after
    the .bin is complete and on disk: a .bin cut short or a .json cut or missing is found on
    the next run, which then builds the cache again."""
    key = f"{data_key}-{tokenizer_fingerprint(tok)}"
    folder = cache_files.cache_folder(cache_dir / "tokens")
    bin_path, meta_path = folder / f"{key}.bin", folder / f"{key}.json"
    for path in (bin_path, meta_path):
        cache_files.drop_link(path, say)
    tokens, damage = _open_token_cache(bin_path, meta_path)
    if tokens is not None:
        return tokens
    if damage:
        say(f"token cache {bin_path} was damaged ({damage}); rebuilding")
    dtype = np.uint16 if len(tok) <= 65535 else np.uint32
    say(f"tokenizing {len(files)} file(s) into the token cache (once per corpus and tokenizer)")
    with cache_files.building("building the token cache", "the token cache", bin_path) as temps:
        tmp = bin_path.with_suffix(f".tmp{os.getpid()}")
        cache_files.remove(tmp)  # a leftover (a planted link too) unlinked, so the open below makes a new file
        temps.append(tmp)
        n_tokens = _tokenize_into(tmp, files, tok, dtype)
        if n_tokens <= len(files):
            raise UsageError("DATA_PATH: the data holds no text to train on")
        os.replace(tmp, bin_path)
        temps.append(bin_path)  # without its manifest it is of no use: removed if that fails
        manifest = {"n_tokens": n_tokens, "dtype": np.dtype(dtype).name, "bytes": n_tokens * np.dtype(dtype).itemsize}
        cache_files.write_json(meta_path, {**manifest, "files": len(files)}, temps)
    say(f"cached {n_tokens:,} tokens from {len(files)} file(s) in {bin_path}")
    return np.memmap(bin_path, dtype=dtype, mode="r", shape=(n_tokens,))


def _open_token_cache(bin_path: Path, meta_path: Path) -> tuple[np.memmap | None, str | None]:
    """(tokens, None) for a sound cache; (None, what is wrong) for a damaged one; (None, None)
    when there is none yet."""
    if not bin_path.exists() and not meta_path.exists():
        return None, None
    try:
        meta = json.loads(meta_path.read_text())
        n_tokens, dtype = int(meta["n_tokens"]), np.dtype(meta["dtype"])
        size = bin_path.stat().st_size
    except FileNotFoundError as err:
        return None, f"{Path(err.filename).name} is missing"
    except (ValueError, KeyError, TypeError) as err:
        return None, f"{meta_path.name} cannot be read: {cache_files.short(err)}"
    except OSError as err:
        raise UsageError(f"CACHE_DIR: cannot read the token cache {bin_path}: {err.strerror or err}") from None
    expected = n_tokens * dtype.itemsize
    if n_tokens <= 0 or dtype.name not in ("uint16", "uint32") or meta.get("bytes", expected) != expected:
        return None, f"{meta_path.name} does not describe a token cache"
    if size != expected:
        return None, f"{bin_path.name} holds {size:,} bytes, {meta_path.name} says {expected:,}"
    return np.memmap(bin_path, dtype=dtype, mode="r", shape=(n_tokens,)), None


def _tokenize_into(path: Path, files: list[Path], tok, dtype) -> int:
    """The token ids of every document, end-of-text after each, written to path (fsynced);
    returns how many."""
    from tqdm import tqdm

    eos_id = tok.convert_tokens_to_ids(tok.eos_token)
    n_tokens, batch = 0, []
    with open(path, "wb") as out, tqdm(desc="tokenizing", unit="chunk", leave=False, disable=None) as bar:

        def flush():
            nonlocal n_tokens
            encoded = tok(batch, add_special_tokens=False)["input_ids"]
            for ids in encoded:
                out.write(np.asarray(ids, dtype=dtype).tobytes())
                n_tokens += len(ids)
            bar.update(len(batch))
            batch.clear()

        for chunk in iter_chunks(files):
            if chunk == EOS:
                if batch:
                    flush()
                out.write(np.asarray([eos_id], dtype=dtype).tobytes())
                n_tokens += 1
                continue
            batch.append(chunk)
            if len(batch) >= 64:
                flush()
        if batch:
            flush()
        out.flush()
        os.fsync(out.fileno())
    return n_tokens


class PackedDataset(Dataset):
    """Non-overlapping windows of max_length tokens over the token stream (documents packed
    back to back, separated by the end-of-text token): no padding, every token trains."""

    def __init__(self, tokens: np.memmap, max_length: int):
        self.tokens, self.max_length = tokens, max_length
        self._source = (tokens.filename, tokens.dtype.name, len(tokens))

    def __getstate__(self):
        # Workers reopen the memmap rather than receiving a pickled copy of every token.
        return {"max_length": self.max_length, "_source": self._source, "tokens": None}

    def __len__(self) -> int:
        return self._source[2] // self.max_length

    def __getitem__(self, index: int) -> dict:
        if self.tokens is None:
            filename, dtype, n = self._source
            self.tokens = np.memmap(filename, dtype=dtype, mode="r", shape=(n,))
        start = index * self.max_length
        window = np.asarray(self.tokens[start : start + self.max_length], dtype=np.int64)
        return {"input_ids": torch.from_numpy(window)}


class EpochSampler(Sampler):
    """A seeded shuffle per epoch; `start` skips the samples already consumed (a resumed position).

    With several processes every rank draws the same permutation and takes a disjoint share of
    it, perm[rank::world_size] after trimming to a multiple of world_size (equal shares, so no
    rank waits for another at the end of an epoch). `start` is the global position, samples of
    the whole permutation consumed by all ranks together: dealt in turn, the first start of the
    permutation are start // world_size of each rank's share. A position saved by a run with
    another number of processes therefore carries over (to within world_size - 1 samples)."""

    def __init__(self, n: int, seed: int, rank: int = 0, world_size: int = 1):
        self.n, self.seed, self.epoch, self.start = n, seed, 0, 0
        self.rank, self.world_size = rank, world_size

    def set_position(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        perm = torch.randperm(self.n, generator=generator)[: self.n - self.n % self.world_size]
        yield from perm[self.rank :: self.world_size][self.start // self.world_size :].tolist()

    def __len__(self) -> int:
        return max(0, self.n // self.world_size - self.start // self.world_size)
