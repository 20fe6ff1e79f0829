"""Tokens per Chinese character: the kit's default BPE against one trained on Chinese text.

(a) the BPE a pretraining run without DATA_PATH or TOKENIZER_PATH uses: trained by the kit's
    own train/data/text.py load_tokenizer on the built-in corpus (this Python's standard-library
    sources) at VOCAB_SIZE, the same cache key, so an existing CACHE_DIR/tokenizers entry is
    reused; (b) for each ordered pair of the given Chinese files, a BPE trained by the same
    function (_train_tokenizer, the kit's byte-level BPE) on the first and measured on the
    second's lines the first does not hold (held out), and on itself as a fit (the best case,
    not a fair figure). A tokenizer given with
    --tokenizer_path is measured too.

Only runs of Chinese characters count (CJK ideographs and CJK / full-width punctuation); the
Latin letters, digits and newlines the files also hold are left out of both numbers. Each run is
encoded alone. Usage, from the repository root (any UTF-8 Chinese text files will do; Python's
own test suite ships two small ones):

    .venv/bin/python bench/tokens_per_char.py \\
        $(.venv/bin/python -c "import test, os;
        print(os.path.dirname(test.__file__))")/cjkencodings/gb2312-utf8.txt \\ $(.venv/bin/python -c "import
        test, os; print(os.path.dirname(test.__file__))")/cjkencodings/gb18030-utf8.txt [--vocab_size 8192]
        [--cache_dir .cache] [--tokenizer_path FOLDER]
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CHINESE = re.compile(r"[\u3000-\u303f\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff00-\uffef]+")


def per_char(tok, text: str) -> tuple[int, int]:
    """(tokens, characters) over the text's runs of Chinese characters, each encoded alone."""
    runs = CHINESE.findall(text)
    return sum(len(tok.encode(run, add_special_tokens=False)) for run in runs), sum(map(len, runs))


def row(name: str, tok, text: str, measured_on: str) -> None:
    tokens, chars = per_char(tok, text)
    print(f"{name:<52} {measured_on:<34} {chars:>6} {tokens:>7} {tokens / chars:>8.2f}")


def main() -> None:
    from train.data import text as text_lib

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path, help="UTF-8 Chinese text files")
    parser.add_argument("--vocab_size", type=int, default=8192)
    parser.add_argument("--cache_dir", default=str(Path(__file__).resolve().parents[1] / ".cache"))
    parser.add_argument("--tokenizer_path", default=None)
    args = parser.parse_args()
    texts = {p.name: p.read_text(encoding="utf-8") for p in args.files}
    for name, text in texts.items():
        print(f"{name}: {len(text.encode())} bytes, {len(text)} characters, "
              f"{sum(map(len, CHINESE.findall(text)))} of them Chinese")  # fmt: skip
    quiet = lambda *_: None  # noqa: E731
    files = text_lib.builtin_corpus_files()
    key = text_lib.corpus_fingerprint(files, "text", Path(args.cache_dir) / "sums")
    default = text_lib.load_tokenizer(None, files, key, args.vocab_size, Path(args.cache_dir), print)
    print(f"\n{'tokenizer':<52} {'measured on':<34} {'chars':>6} {'tokens':>7} {'tok/char':>8}")
    for name, text in texts.items():
        row(f"(a) kit default: BPE {args.vocab_size} on the built-in corpus", default, text, name)
    if args.tokenizer_path:
        given = text_lib.load_tokenizer(args.tokenizer_path, [], "", 0, Path(args.cache_dir), print)
        for name, text in texts.items():
            row(f"TOKENIZER_PATH {args.tokenizer_path}", given, text, name)
    for train_name, train_text in texts.items():
        trained = text_lib._train_tokenizer(iter(train_text.splitlines()), args.vocab_size, quiet)
        label = f"(b) BPE on {train_name} ({len(trained.get_vocab())} tokens)"
        seen = set(train_text.splitlines())  # a line both files hold is not held out
        for name, text in texts.items():
            if name == train_name:
                row(label + ", fit", trained, text, name + " (itself)")
                continue
            unseen = "\n".join(line for line in text.splitlines() if line not in seen)
            if CHINESE.search(unseen):
                row(label, trained, unseen, name + " (unseen lines)")


if __name__ == "__main__":
    main()
