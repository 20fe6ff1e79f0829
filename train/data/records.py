"""Reading DATA_PATH, streamed: text files, JSON / JSONL (.jsonl.gz too), parquet, Arrow.

One reader for every mode. Pretraining takes texts (`iter_texts`: the TEXT_FIELD column of
records, or whole .txt/.md files in bounded pieces); SFT takes records (`iter_records`: dicts,
exactly as a JSON line would give them, from any of the formats). Nothing here reads a source
whole except a .json file, which is one JSON value and can only be parsed whole: memory follows
the batch or block being read, not the file. pyarrow reads parquet and Arrow (it is what the
datasets library stands on), so a folder written by `datasets.Dataset.save_to_disk` is read
without that package.

Every failure is a UsageError whose one line names the file and, where there is one, the line
or row: "DATA_PATH: <file> line 7: not valid JSON (...)".
"""

from __future__ import annotations

import codecs
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from train.core.errors import UsageError
from train.data.columnar import (  # noqa: F401 (read through here: one reader for every mode)
    ROWS_PER_BATCH,
    SkippedRows,
    as_python,
    is_text_type,
    record_batches,
    text_column,
)
from train.data.json_lines import (  # noqa: F401 (jsonl_blocks, parse_jsonl_block: read through here)
    BadLine,
    json_list,
    jsonl_blocks,
    parse_jsonl_block,
    suffix_of,
)
from train.data.json_lines import fail as _fail

TEXT_SUFFIXES = (".txt", ".md")
RECORD_SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet", ".arrow")
# A .json file is one value (a list of records): read when named, not picked up from a folder,
# where .json files are more often metadata than data.
JSON_SUFFIX = ".json"
# Documents are cut at the first line end after this many characters, so the tokenizer gets
# pieces of similar size to spread over its threads and workers. Token ids are the same as for
# the whole document wherever a cut falls after a newline that starts a non-space character.
CHUNK_CHARS = 1 << 16
# A "line" longer than this (a file without newlines) is cut at the last space before it.
MAX_PIECE_CHARS = 1 << 22
BLOCK_BYTES = 1 << 20


@contextmanager
def reading(variable: str):
    """Errors about the files read inside name `variable`: VAL_PATH's files are read by the
    same code as DATA_PATH's, and "DATA_PATH: val.jsonl line 3" sends the user to the wrong
    variable. Raised where they happen (worker processes included), renamed here, once."""
    try:
        yield
    except UsageError as err:
        text = str(err)
        if variable == "DATA_PATH" or not text.startswith("DATA_PATH"):
            raise
        raise UsageError(variable + text[len("DATA_PATH"):]) from None


def is_arrow_folder(path: Path) -> bool:
    """A folder written by datasets' save_to_disk: state.json and data-*.arrow files."""
    return path.is_dir() and (path / "state.json").is_file() and any(path.glob("*.arrow"))


def _wanted(path: Path, named: bool) -> bool:
    if path.is_dir():
        return is_arrow_folder(path)
    suffix = suffix_of(path)
    return suffix in TEXT_SUFFIXES + RECORD_SUFFIXES or (named and suffix == JSON_SUFFIX)


def _regular(path: Path) -> bool:
    """A FIFO, socket or device named like data would block or never end on open: skipped with
    a note and never opened (stat follows a link to what it names, as open would)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False  # a dangling link: nothing to read
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return True
    kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
    print(f"note: DATA_PATH: skipped {path}: {kind}, not a regular file", flush=True)
    return False


def _walk(folder: Path) -> list[Path]:
    found = []
    for root, dirs, files in os.walk(folder):  # links to folders are not followed: no loops
        here = Path(root)
        keep = []
        for name in sorted(dirs):
            if name.startswith("."):
                continue
            if is_arrow_folder(here / name):
                found.append(here / name)  # one source; its .arrow files are read through it
            else:
                keep.append(name)
        dirs[:] = keep
        names = [f for f in sorted(files) if not f.startswith(".") and _wanted(here / f, False)]
        found += [here / f for f in names if _regular(here / f)]
    return found


def glob_matches(pattern: str) -> Iterator[Path]:
    """A glob pattern's matches, "**" included, without following links to folders (pathlib's
    rule; glob.glob follows them, and a link to a parent folder made it walk forever)."""
    parts = Path(pattern).parts
    first = next((i for i, part in enumerate(parts) if any(c in part for c in "*?[")), len(parts))
    root = Path(*parts[:first]) if first else Path(".")
    if first == len(parts) or not root.is_dir():
        return iter([root] if first == len(parts) and root.exists() else [])
    rest = parts[first:]
    hidden = any(part.startswith(".") for part in rest)  # as glob.glob: "*" skips dot names
    return (m for m in root.glob("/".join(rest)) if hidden or not any(
        part.startswith(".") for part in m.relative_to(root).parts))


def source_files(data_path: str) -> list[Path]:
    """DATA_PATH as a sorted list of sources: a file, a folder (searched through, formats may be
    mixed; a datasets save_to_disk folder counts as one source), or a glob pattern."""
    kinds = ".txt, .md, .jsonl, .jsonl.gz, .parquet or .arrow files, nor an Arrow (save_to_disk) folder"
    if any(c in data_path for c in "*?["):
        found = []
        named = data_path.lower().endswith(JSON_SUFFIX)  # "dir/*" skips a stray meta.json, as "dir" does
        for path in sorted(glob_matches(data_path)):
            if is_arrow_folder(path) or not path.is_dir():
                found += [path] if _wanted(path, named) and _regular(path) else []
            else:
                found += _walk(path)
        if not found:
            raise UsageError(f"DATA_PATH: the pattern {data_path} matches no {kinds}")
        return sorted(set(found))
    path = Path(data_path)
    if not path.exists():
        raise UsageError(f"DATA_PATH: {path}: no such file or folder")
    if is_arrow_folder(path):
        return [path]
    if not path.is_dir():
        if not _regular(path):
            raise UsageError(f"DATA_PATH: {path} is not a regular file (a FIFO, socket or device); name a "
                             f"file")
        return [path]
    found = _walk(path)
    if not found:
        raise UsageError(f"DATA_PATH: folder {path} holds no {kinds}")
    return sorted(found)


# --- records (SFT) and texts (pretraining) -----------------------------------------------------


def iter_records(path: Path, keep_bad_lines: bool = False) -> Iterator[tuple[str, object]]:
    """(where, record) for each record of one source: "line N" (JSONL), "record N" (a .json
    list) or "row N" (parquet, Arrow). Records of parquet and Arrow are dicts of the row's
    columns, as JSON lines give them. A .json list is read whole (JSON has no streaming form
    here); every other format is streamed. A line that is not JSON stops with a UsageError, or
    is yielded as a BadLine with keep_bad_lines (for SKIP_BAD_RECORDS), as is each row of a parquet
    row group or Arrow batch row over MAX_RECORD_MB (read past, never decompressed or converted)."""
    suffix = suffix_of(path)
    if path.is_dir() or suffix in (".parquet", ".arrow"):
        row = 0
        for batch in record_batches(path, skip_long=keep_bad_lines):
            for record in (
                [batch] * batch.rows if isinstance(batch, SkippedRows) else as_python(path, batch, row + 1)
            ):
                row += 1
                yield f"row {row}", record
        return
    if suffix == JSON_SUFFIX:
        data = json_list(path)
        if data is not None:
            yield from ((f"record {i}", record) for i, record in enumerate(data, 1))
            return
    for first_line, block in jsonl_blocks(path, skip_long=keep_bad_lines):
        if isinstance(block, BadLine):  # a line over MAX_RECORD_MB, read past (SKIP_BAD_RECORDS)
            yield f"line {first_line}", block
            continue
        yield from parse_jsonl_block(path, first_line, block, keep_bad_lines)


def is_text_file(path: Path) -> bool:
    """A source read as one document of plain text (.txt, .md, or a named file of no known kind)."""
    return not path.is_dir() and suffix_of(path) not in RECORD_SUFFIXES + (JSON_SUFFIX,)


def split_document(doc: str) -> Iterator[str]:
    """A document in pieces of about CHUNK_CHARS, cut after a line end (nothing for "")."""
    start = 0
    while start < len(doc):
        end = doc.find("\n", start + CHUNK_CHARS)
        end = len(doc) if end == -1 else end + 1
        if end - start > MAX_PIECE_CHARS:
            end = _cut_long(doc, start)
        yield doc[start:end]
        start = end


def _cut_long(doc: str, start: int) -> int:
    space = doc.rfind(" ", start + 1, start + MAX_PIECE_CHARS)
    return space if space > start else start + MAX_PIECE_CHARS


def text_file_pieces(path: Path) -> Iterator[str]:
    """A .txt/.md file as the pieces split_document would give for its whole text, read in
    blocks: the same cuts, so the same token ids, without the file ever in memory."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, buffer = 0, ""
    try:
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(BLOCK_BYTES), b""):
                try:
                    buffer += decoder.decode(block)
                except UnicodeDecodeError as err:
                    raise _fail(
                        path, "", f"is not UTF-8 text (bad byte at offset {offset + err.start})"
                    ) from None
                offset += len(block)
                buffer = yield from _emit_ready(buffer)
            try:
                buffer += decoder.decode(b"", final=True)
            except UnicodeDecodeError:
                raise _fail(path, "", f"is not UTF-8 text (cut character at offset {offset})") from None
    except OSError as err:
        raise _fail(path, "", f"cannot be read ({err.strerror or err})") from None
    yield from split_document(buffer)


def _emit_ready(buffer: str):
    """Yield the pieces of buffer that no later text can change; return what is left."""
    start = 0
    while True:
        end = buffer.find("\n", start + CHUNK_CHARS)
        if end == -1:
            if len(buffer) - start > MAX_PIECE_CHARS:
                end = _cut_long(buffer, start) - 1
            else:
                return buffer[start:]
        elif end + 1 - start > MAX_PIECE_CHARS:
            end = _cut_long(buffer, start) - 1
        yield buffer[start : end + 1]
        start = end + 1


def record_text(path: Path, where: str, record: object, field: str) -> str:
    if not isinstance(record, dict) or not isinstance(record.get(field), str):
        raise _fail(path, where, f'expected an object with a "{field}" string (TEXT_FIELD)')
    return record[field]


def iter_texts(path: Path, text_field: str = "text") -> Iterator[str]:
    """The documents of one source for pretraining, as pieces of at most ~CHUNK_CHARS (cut
    after a line end) with "" after each document's last piece: a .txt/.md file is one
    document; each record (JSON object, parquet or Arrow row) is one, its TEXT_FIELD the text.
    Parquet and Arrow read only that column, as a column; null values are skipped."""
    if is_text_file(path):
        yield from text_file_pieces(path)
        yield ""
        return
    if path.is_dir() or suffix_of(path) in (".parquet", ".arrow"):
        row = 1
        for batch in record_batches(path, [text_field]):
            docs, row = text_column(path, batch, text_field, row), row + batch.num_rows
            for doc in docs:
                if doc is not None:
                    yield from split_document(doc)
                    yield ""
        return
    for where, record in iter_records(path):
        yield from split_document(record_text(path, where, record, text_field))
        yield ""
