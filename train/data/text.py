"""Text -> tokenizer -> token cache on disk (memmap) -> packed Dataset -> DataLoader.

The token cache is keyed by the data's content and the tokenizer, so a second run starts at
once, and workers read the same memmap pages instead of each holding a copy.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from train.core.errors import UsageError
from train.core.remote_code import refuse_custom_code
from train.data import cache_files, json_lines, records, token_shards, tokenize

EOS = "<|endoftext|>"
PAD = "<|pad|>"  # only where a model config puts pad apart from end-of-text (special_layout)
RESERVED_IDS = 8  # special ids a model config may ask a trained BPE to lay out
CACHE_VERSION = "1"
# Standard-library folders left out of the built-in corpus: tests are huge and repetitive.
_SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "lib2to3", "__pycache__", "turtledemo", "tkinter"}
# Enough text for a byte-level BPE of 8-50k tokens to find its merges; the sample is spread
# through the corpus, and its size is part of the tokenizer's cache key.
DEFAULT_SAMPLE_MB = 100.0


def builtin_corpus_files() -> list[Path]:
    """The running Python's standard-library sources: text on every machine with Python."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("."))
        found += [Path(folder) / f for f in sorted(files) if f.endswith(".py")]
    return found


def corpus_files(data_path: str | None) -> list[Path]:
    """The sources to train on: DATA_PATH (a file, a folder or a glob; train/data/records.py)
    or the built-in corpus."""
    if data_path is None:
        return builtin_corpus_files()
    return records.source_files(data_path)


def corpus_fingerprint(files: list[Path], text_field: str = "text", sums: Path | None = None,
                       variable: str = "DATA_PATH") -> str:
    """sha256 over every source's name and bytes (an Arrow folder: its .arrow files) and
    TEXT_FIELD: the cache key for the data. sums (CACHE_DIR/sums): each file's digest kept by
    path, size, mtime, ctime and inode, so a warm start does not read the whole corpus again
    (sums itself a link: refused, CACHE_DIR's folders are never read through one)."""
    if sums is not None:
        cache_files.refuse_link(sums)
    digest = hashlib.sha256(CACHE_VERSION.encode())
    if text_field != "text":
        digest.update(f"text_field={text_field}\0".encode())
    for path in files:
        digest.update(path.name.encode() + b"\0")
        parts = sorted(path.glob("*.arrow")) if path.is_dir() else [path]
        for part in parts:
            digest.update(cache_files.file_digest(part, sums, variable)[0].encode() + b"\0")
    return digest.hexdigest()[:20]


def sample_pieces(files: list[Path], text_field: str, sample_mb: float, say) -> Iterator[str]:
    """The texts the BPE trains on: the whole corpus up to TOKENIZER_SAMPLE_MB, else every k-th
    unit (~1 MB) of it, so the sample is spread through the corpus rather than its first part."""
    from tqdm import tqdm

    total, budget = sum(tokenize.source_size(p) for p in files), int(sample_mb * (1 << 20))
    stride = max(1, -(-total // max(budget, 1)))
    if stride == 1:
        say(f"training the tokenizer on the whole corpus ({total / 1e6:,.1f} MB; "
            f"TOKENIZER_SAMPLE_MB={sample_mb:g})")
    else:
        say(f"training the tokenizer on a {sample_mb:g} MB sample of the {total / 1e6:,.1f} MB corpus: one "
            f"part in {stride}, spread through it (TOKENIZER_SAMPLE_MB)")  # fmt: skip
    taken = 0
    with tqdm(
        total=min(total, budget),
        desc="tokenizer sample",
        unit="B",
        unit_scale=True,
        leave=False,
        disable=None,
    ) as bar:
        for index, (_, unit, size) in enumerate(tokenize.iter_units(files, text_field)):
            if index % stride:
                continue
            yield from (p for p in tokenize.unit_pieces(unit) if p)
            taken += size
            bar.update(size)
            if stride > 1 and taken >= budget:
                return


def load_tokenizer(
    tokenizer_path: str | None,
    files: list[Path],
    key: str,
    vocab_size: int,
    cache_dir: Path,
    say,
    text_field: str = "text",
    sample_mb: float = DEFAULT_SAMPLE_MB,
    texts=None,
    specials: tuple[str, ...] = (EOS,),
):
    """A local AutoTokenizer folder, or a byte-level BPE trained on (a sample of) the corpus and
    cached. texts: a callable giving the texts to train on instead of sample_pieces' (SFT's
    turns); specials: the special tokens at ids 0, 1 ... (special_layout), EOS among them."""
    from transformers import AutoTokenizer

    if tokenizer_path is not None:
        # Pretraining has no TRUST_REMOTE_CODE: a tokenizer folder never runs its own code here.
        refuse_custom_code(tokenizer_path, "TOKENIZER_PATH")
        try:
            tok = AutoTokenizer.from_pretrained(
                tokenizer_path, local_files_only=True, trust_remote_code=False
            )
        except (OSError, ValueError) as err:
            raise UsageError(
                f"TOKENIZER_PATH: cannot load a tokenizer from {tokenizer_path}: {err}"
            ) from None
        if tok.eos_token is None:
            tok.add_special_tokens({"eos_token": EOS})
        return tok
    total = sum(tokenize.source_size(p) for p in files)
    sampled = f"-s{sample_mb:g}" if total > sample_mb * (1 << 20) else ""
    laid = "" if specials == (EOS,) else "-" + hashlib.sha256("\0".join(specials).encode()).hexdigest()[:8]
    folder = cache_dir / "tokenizers" / f"bpe-{vocab_size}-{key}{sampled}{laid}"
    # Before the training, not after: an unusable CACHE_DIR stops the run before minutes of work.
    parent = cache_files.cache_folder(folder.parent)
    # One process per machine trains it (torchrun): the others wait, then load the same files.
    with token_shards.locked(parent, "a tokenizer", say):
        source = "the SFT data" if texts else "the corpus"
        texts = texts or (lambda: sample_pieces(files, text_field, sample_mb, say))
        return _cached_or_trained(folder, texts, vocab_size, say, specials, source)


def special_layout(pad_id: int | None, eos_id: int | None) -> tuple[str, ...] | None:
    """The special tokens of a trained BPE that put end-of-text (and pad, where it differs) at a
    model config's own ids (ChatLM's: pad 0, eos 1), the ids between them reserved; None where
    those ids are not small (a config made for another tokenizer, GPT-2's eos 50256)."""
    if not isinstance(eos_id, int) or eos_id < 0:
        return None
    at = {eos_id: EOS}
    if isinstance(pad_id, int) and pad_id >= 0 and pad_id != eos_id:
        at[pad_id] = PAD
    if max(at) >= RESERVED_IDS:
        return None
    return tuple(at.get(i, f"<|reserved_{i}|>") for i in range(max(at) + 1))


def _cached_or_trained(folder: Path, texts, vocab_size: int, say, specials: tuple[str, ...], source: str):
    from transformers import PreTrainedTokenizerFast

    cache_files.drop_link(folder, say)
    if folder.is_dir() and any(p.is_symlink() for p in folder.iterdir()):
        # a file of it linked elsewhere would be read by transformers: not a folder this kit saved
        say(f"tokenizer cache {folder} holds a symbolic link, not a cache this kit wrote; removed, building "
            f"it again")
        cache_files.remove(folder)
    if folder.exists():
        try:  # its files as they were saved (kit-sha256.json), then loadable
            if damage := cache_files.unsealed(folder):
                raise ValueError(damage)
            return PreTrainedTokenizerFast.from_pretrained(folder, local_files_only=True)
        except Exception as err:  # a cut or missing file (the library raises several kinds)
            say(f"tokenizer cache {folder} was damaged ({cache_files.short(err)}); rebuilding")
            cache_files.remove(folder)
            if folder.exists():
                raise UsageError(f"CACHE_DIR: cannot remove the damaged tokenizer cache {folder}") from None
    with cache_files.building("training the tokenizer", "the tokenizer", folder) as temps:
        tok = _train_tokenizer(json_lines.carried(texts()), vocab_size, say, specials, source)
        if not cache_files.save_folder(
            folder, lambda tmp: (tok.save_pretrained(tmp), cache_files.seal(tmp)), temps
        ):
            # Another run on the same corpus (same key) saved it first: use that one, so every
            # run of this corpus tokenizes with the same files.
            return PreTrainedTokenizerFast.from_pretrained(folder, local_files_only=True)
    return tok


def _train_tokenizer(pieces: Iterator[str], vocab_size: int, say, specials: tuple[str, ...] = (EOS,),
                     source: str = "the corpus"):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    say(f"training a byte-level BPE tokenizer (vocab {vocab_size}) on {source}; cached for next time")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(specials),  # ids 0, 1 ... in this order
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(pieces, trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, bos_token=EOS, unk_token=None)
    tok.pad_token = PAD if PAD in specials else EOS
    return tok


# The tokenizer's tokens per UTF-8 byte on the data's first text, against its rate on English and
# Python (the standard library: the default BPE's own corpus): a tokenizer that has learned no merges
# for the data's language falls back to bytes (Chinese on the default BPE: 3.0 tokens a character,
# 1.0 a byte, 4x its rate on its own text), fitting a third of the text into MAX_LENGTH.
FIT_SAMPLE_CHARS = 64 << 10
FIT_RATIO = 2.5
# tokens per byte: a tokenizer made for other text than Python is held to what a BPE spends there
OWN_RATE_CAP = 0.35


def language_note(tok, texts, say, variable: str = "DATA_PATH") -> None:
    """A note when the tokenizer spends far more tokens per byte on the data's first texts (about
    64 kB) than on its own kind of text, pointing to VOCAB_SIZE (a BPE trained on the data) and
    TOKENIZER_PATH. ~30 ms: two encodes of 64 kB."""
    taken, sample = 0, []
    for text in texts:
        sample.append(text[: FIT_SAMPLE_CHARS - taken])
        taken += len(sample[-1])
        if taken >= FIT_SAMPLE_CHARS:
            break
    data = "\n".join(sample)
    try:
        own = "".join(Path(sysconfig.get_paths()["stdlib"], name).read_text(encoding="utf-8")
                      for name in ("textwrap.py", "shlex.py"))[:FIT_SAMPLE_CHARS]  # fmt: skip
    except (OSError, UnicodeDecodeError):  # a Python without its sources: no reference, no note
        return
    if len(data) < 200:
        return
    rate = [len(tok(t, add_special_tokens=False)["input_ids"]) / len(t.encode("utf-8")) for t in (data, own)]
    rate[1] = min(rate[1], OWN_RATE_CAP)
    if rate[0] > FIT_RATIO * rate[1]:
        per_char = rate[0] * len(data.encode("utf-8")) / len(data)
        say(f"note: the tokenizer spends {per_char:.2f} tokens per character on {variable}'s first records, "
            f"{rate[0] / rate[1]:.1f}x its rate on English and code: it knows little of this language "
            f"(bytes, not "
            "words), so a third as much text fits MAX_LENGTH and long records are cut. Train a BPE on the "
            "data "
            "(leave TOKENIZER_PATH empty; raise VOCAB_SIZE for a language of thousands of characters) or "
            "give one "
            "that knows the language (TOKENIZER_PATH, or a MODEL_PATH made for it); see docs/data.md")


# T5's sentinels, one per noise span of a span-corrupted window (train/data/span_corruption.py);
# T5's tokenizers carry 100 of them.
SENTINEL = "<extra_id_{}>"
T5_SENTINELS = 100


def sentinel_ids(tok, needed: int) -> tuple[list[int], int]:
    """(ids of <extra_id_0> ... <extra_id_{n-1}>, how many were added), n = max(100, needed). A
    tokenizer with T5's sentinels keeps its own ids; the kit's BPE (or any other) gets the
    missing ones as special tokens: never split, saved with final/, dropped by
    decode(skip_special_tokens=True). Add them after the token cache is built, so the cache's
    key (the tokenizer's fingerprint) is the one GPT-2 runs on the same corpus share."""
    names = [SENTINEL.format(i) for i in range(max(T5_SENTINELS, needed))]
    vocab = tok.get_vocab()
    missing = [name for name in names if name not in vocab]
    if missing:
        tok.add_special_tokens({"extra_special_tokens": missing}, replace_extra_special_tokens=False)
    return tok.convert_tokens_to_ids(names), len(missing)


def tokenizer_fingerprint(tok) -> str:
    state = tok.backend_tokenizer.to_str() if hasattr(tok, "backend_tokenizer") else repr(tok.get_vocab())
    return hashlib.sha256(state.encode()).hexdigest()[:20]


def token_cache(files: list[Path], data_key: str, tok, cache_dir: Path, say, text_field: str = "text",
                workers: int | None = None):  # fmt: skip
    """The corpus as token ids, built once into sharded files and read through memmaps
    (train/data/token_shards.py): a np.memmap for one shard, a TokenStream over several."""
    return token_shards.token_cache(files, f"{data_key}-{tokenizer_fingerprint(tok)}", tok, cache_dir, say,
                                   text_field, workers)  # fmt: skip


class PackedDataset(Dataset):
    """Non-overlapping windows of max_length tokens over the token stream (documents packed
    back to back, separated by the end-of-text token): no padding, every token trains."""

    def __init__(self, tokens: np.memmap | token_shards.TokenStream, max_length: int):
        self.tokens, self.max_length = tokens, max_length
        # A TokenStream pickles as its file names; a memmap as (file, dtype, length).
        self._source = (
            tokens
            if isinstance(tokens, token_shards.TokenStream)
            else (tokens.filename, tokens.dtype.name, len(tokens))
        )

    def __getstate__(self):
        # Workers reopen the memmap rather than receiving a pickled copy of every token.
        return {"max_length": self.max_length, "_source": self._source, "tokens": None}

    def __len__(self) -> int:
        return (
            len(self._source) // self.max_length
            if isinstance(self._source, token_shards.TokenStream)
            else self._source[2] // self.max_length
        )

    def __getitem__(self, index: int) -> dict:
        if self.tokens is None:
            if isinstance(self._source, token_shards.TokenStream):
                self.tokens = self._source
            else:
                filename, dtype, n = self._source
                self.tokens = np.memmap(filename, dtype=dtype, mode="r", shape=(n,))
        start = index * self.max_length
        window = np.asarray(self.tokens[start : start + self.max_length], dtype=np.int64)
        return {"input_ids": torch.from_numpy(window)}


def epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The seeded order of one epoch's n samples. Every training sampler starts from it (the
    length-grouped one too), so runs that differ in batching train the same samples under a
    budget (make compare-sft: batch 1 against grouped batches of 16)."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


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
        perm = epoch_order(self.n, self.seed, self.epoch)[: self.n - self.n % self.world_size]
        yield from perm[self.rank :: self.world_size][self.start // self.world_size :].tolist()

    def __len__(self) -> int:
        return max(0, self.n // self.world_size - self.start // self.world_size)
