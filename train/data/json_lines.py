"""JSON and JSONL records, and parquet / Arrow rows, with a bound on what one record may cost
(train/data/records.py reads through here).

A record is user data, and one line can be made to cost without limit: a .jsonl.gz of 3 MB that
expands to one 3 GB line, nesting 200,000 deep, a 5,000-digit number, a lone surrogate
("\\ud800") that no tokenizer can encode. Each is one line naming the file and the line, found
before the rest of the file is read. The bounds cost nothing on normal lines: the line length
is a count the block reader keeps anyway; depth and digits are Python's own limits, caught;
surrogates are looked for only in lines that spell one as an escape.
"""

from __future__ import annotations

import contextvars
import gzip
import json
import re
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from train.core.errors import UsageError

BLOCK_BYTES = 1 << 20
# The longest line (decompressed) a JSONL record may be. Real records are text of a few pages
# to a few books (kB to a few MB); past this a line is a mistake or a decompression bomb, and
# parsing it would take ~10x its size in Python objects. MAX_RECORD_MB sets it for a run
# (record_limit); lines are read in the main process, so a context variable reaches every reader.
MAX_RECORD_BYTES = 64 << 20
_limit = contextvars.ContextVar("max_record_bytes", default=MAX_RECORD_BYTES)


@contextmanager
def record_limit(mb: float):
    """Lines read inside may be up to `mb` MB (decompressed): MAX_RECORD_MB."""
    token = _limit.set(int(mb * (1 << 20)))
    try:
        yield
    finally:
        _limit.reset(token)
def carried(items: Iterator) -> Iterator:
    """items, each next() run in the context of this call: the tokenizers library pulls the texts
    a BPE trains on from a thread of its own, where MAX_RECORD_MB (a context variable) would be
    the default again (a 6 MB row under MAX_RECORD_MB=1 went into the BPE trainer, which spun on it)."""
    context = contextvars.copy_context()

    def run() -> Iterator:
        while True:
            try:
                item = context.run(next, items)
            except StopIteration:
                return
            yield item

    return run()


# An escaped UTF-16 surrogate pair ("\\ud83d\\ude00", one emoji), or a surrogate alone
# ("\\ud800"), which decodes to a str that no UTF-8 encoder accepts. Pairs are common (JSON
# written with ensure_ascii), so the scan keeps to C: a lone one is a match that is not 12 long.
_SURROGATES = re.compile(r"\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}|\\u[dD][89a-fA-F]")


class BadLine(ValueError):
    """One JSON line that cannot be parsed; yielded instead of a record with keep_bad_lines."""


def fail(path: Path, where: str, what: str) -> UsageError:
    place = f" {where}" if where else ""
    sep = " " if what.startswith(("is ", "has ")) else ": "
    return UsageError(f"DATA_PATH: {path}{place}{sep}{what}")


def short(err: BaseException) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return text if len(text) <= 120 else text[:117] + "..."


def suffix_of(path: Path) -> str:
    name = path.name.lower()
    return ".jsonl.gz" if name.endswith(".jsonl.gz") else path.suffix.lower()


def _open_lines(path: Path):
    if suffix_of(path) == ".jsonl.gz":
        return gzip.open(path, "rb")
    return open(path, "rb")


def record_bytes() -> int:
    """The bound on one record in bytes (MAX_RECORD_MB, as record_limit set it)."""
    return _limit.get()


def too_long(limit: int, found: str = "") -> str:
    """Why a record over MAX_RECORD_MB is refused; found: its size where it is known (a row)."""
    mb = f"{limit / (1 << 20):g}"
    what = f"is {found} decompressed, over MAX_RECORD_MB={mb}" if found else (f"is longer than {mb} MB "
                                                                              f"(decompressed)")
    return (f"{what}: one record that large is a mistake or a decompression bomb; split it, or raise "
            f"MAX_RECORD_MB={mb} if it is real")


def jsonl_blocks(
    path: Path, block_bytes: int = BLOCK_BYTES, skip_long: bool = False
) -> Iterator[tuple[int, bytes]]:
    """(number of the block's first line, whole lines of about block_bytes): a JSONL file (or
    .jsonl.gz, decompressed as it goes) in pieces that can be parsed apart, in parallel. A line
    longer than MAX_RECORD_MB stops the read as soon as that much of it has been read; with
    skip_long (SKIP_BAD_RECORDS) it is read past instead, never held, and given as (its number,
    a BadLine) for the caller to count."""
    line, limit = 1, _limit.get()
    try:
        with _open_lines(path) as handle:
            parts: list[bytes] = []  # a line's start, not yet ended (joined once it ends)
            held, skipping = 0, False
            for block in iter(lambda: handle.read(block_bytes), b""):
                while block:
                    if skipping:  # the rest of a line over the bound: dropped as it is read
                        end = block.find(b"\n")
                        if end < 0:
                            break
                        block, skipping, line = block[end + 1 :], False, line + 1
                        continue
                    first = block.find(b"\n")
                    if held + (len(block) if first < 0 else first) > limit:
                        if not skip_long:
                            raise fail(path, f"line {line}", too_long(limit))
                        yield line, BadLine(too_long(limit))
                        parts, held, skipping = [], 0, True
                        continue
                    if first < 0:
                        parts.append(block)
                        held += len(block)
                        break
                    cut = block.rfind(b"\n") + 1
                    whole = b"".join([*parts, block[:cut]]) if parts else block[:cut]
                    parts, held = ([block[cut:]], len(block) - cut) if cut < len(block) else ([], 0)
                    yield line, whole
                    line += whole.count(b"\n")
                    break
            if parts:
                yield line, b"".join(parts)
    except (OSError, EOFError, zlib.error) as err:
        raise fail(path, f"near line {line}", f"cannot be read "
                                              f"({getattr(err, 'strerror', None) or short(err)})") from None


def loads(raw: str) -> object:
    """A JSON value whose strings are all encodable text. ValueError with the reason otherwise:
    bad JSON, nesting deeper than the interpreter's recursion limit, an integer over Python's
    4,300 digits, a lone surrogate."""
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as err:
        raise ValueError(f"not valid JSON ({err.msg}, column {err.colno})") from None
    except RecursionError:
        raise ValueError("nested too deep to be a record") from None
    except ValueError as err:  # int(): "Exceeds the limit (4300 digits) for integer string conversion"
        raise ValueError(f"holds a number too long to read ({short(err)})") from None
    if ("\\ud" in raw or "\\uD" in raw) and any(len(m) != 12 for m in _SURROGATES.findall(raw)):
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as err:
            raise ValueError(f"holds a lone surrogate (\\u{ord(err.object[err.start]):04x}), which is not "
                             f"text") from None
    return value


def parse_jsonl_block(path: Path, first_line: int, block: bytes, keep_bad_lines: bool = False):
    """(where, record) for each non-blank line of a block from jsonl_blocks."""
    opening = first_line == 1  # the file's first record is looked at for a JSON list
    for number, raw in enumerate(block.split(b"\n"), first_line):
        if not raw.strip():
            continue
        where = f"line {number}"
        try:
            text = raw.decode("utf-8-sig" if number == 1 else "utf-8")
        except UnicodeDecodeError as err:
            raise fail(
                path, where, f"not UTF-8 (byte 0x{raw[err.start]:02x}); save the file as UTF-8"
            ) from None
        try:
            value = loads(text)
        except ValueError as err:
            if opening:
                refuse_list(path, text, number, None)
            if not keep_bad_lines:
                raise fail(path, where, str(err)) from None
            value = BadLine(str(err))
        if opening and not isinstance(value, BadLine):
            refuse_list(path, text, number, value)
        opening = False
        yield where, value


def refuse_list(path: Path, text: str, number: int, value) -> None:
    """A JSONL file whose first line opens a JSON list (a .json list saved as .jsonl): said as
    what it is, whatever SKIP_BAD_RECORDS says, not as "line 1: not valid JSON" (with a hint to
    skip it that only repeated the same line)."""
    if text.lstrip().startswith("[") and (value is None or isinstance(value, list)):
        raise fail(path, "", f"is a JSON list ('[' on line {number}), not JSON lines (one record per line): "
                   "name it .json, or write one record per line")  # fmt: skip


def json_list(path: Path) -> list | None:
    """The records of a .json list, or None when the file holds JSON lines instead."""
    try:
        with open(path, encoding="utf-8-sig") as handle:
            text = handle.read()
    except UnicodeDecodeError as err:
        raise fail(path, "", f"not UTF-8 (bad byte at offset {err.start}); save the file as UTF-8") from None
    except OSError as err:
        raise fail(path, "", f"cannot be read ({err.strerror or err})") from None
    try:
        data = loads(text)
    except ValueError as err:
        if "Extra data" in str(err):  # a .json file holding JSON lines: common enough to accept
            return None
        line = _error_line(text)
        raise fail(path, f"line {line}" if line else "", str(err)) from None
    if not isinstance(data, list):
        raise fail(path, "", f"expected a JSON list of records, found a {type(data).__name__}")
    return data


def _error_line(text: str) -> int | None:
    try:
        json.loads(text)
    except json.JSONDecodeError as err:
        return err.lineno
    except (ValueError, RecursionError):
        return None
    return None


# --- parquet and Arrow rows: the same bound, and values Python cannot hold ----------------------


def row_groups_bounded(path: Path, meta, columns: list[str] | None, first_row: int, limit: int,
                       skip: bool = False) -> dict[int, tuple[str, str]]:
    """Refused from the file's metadata alone, before anything is decompressed: a row group whose
    columns (those read) decompress to more than MAX_RECORD_MB per row holds at least one row over
    it (a 50 KB zstd file of one 1.5 GB row reached 7 GB before a MemoryError). skip
    (SKIP_BAD_RECORDS): such groups are returned instead, {index: (its rows, why)}, to be read past."""
    over = {}
    for k in range(meta.num_row_groups):
        group = meta.row_group(k)
        size = sum(group.column(j).total_uncompressed_size for j in range(group.num_columns)
                   if columns is None or group.column(j).path_in_schema.split(".")[0] in columns)  # fmt: skip
        if group.num_rows and size > limit * group.num_rows:
            where = (
                f"row {first_row}"
                if group.num_rows == 1
                else f"rows {first_row}-{first_row + group.num_rows - 1}"
            )
            found = f"{size / (1 << 20) / group.num_rows:,.1f} MB" + (
                " a row on average" if group.num_rows > 1 else ""
            )
            if not skip:
                raise fail(path, where, too_long(limit, found))
            over[k] = (where, too_long(limit, found))
        first_row += group.num_rows
    return over


def rows_bounded(path: Path, batch, first_row: int, limit: int, skip: bool = False) -> dict[int, str]:
    """A row of the batch over MAX_RECORD_MB is refused before it becomes Python objects (a str
    of it, its parse, its tokens: ~10x its size). Rows are measured only in a batch over the bound.
    skip (SKIP_BAD_RECORDS): such rows are returned instead, {index in the batch: why}."""
    over = {}
    if batch.nbytes <= limit:
        return over
    for i in range(batch.num_rows):
        if (size := batch.slice(i, 1).nbytes) > limit:
            if not skip:
                raise fail(path, f"row {first_row + i}", too_long(limit, f"{size / (1 << 20):,.1f} MB"))
            over[i] = too_long(limit, f"{size / (1 << 20):,.1f} MB")
    return over


def out_of_range(path: Path, values, first_row: int, err: Exception) -> UsageError:
    """The file, row and column of a value Python cannot hold ("date value out of range",
    "days=2147483647; must have magnitude <= 999999999")."""
    names = values.schema.names if hasattr(values, "schema") else [None]
    for name, column in zip(names, values.columns if hasattr(values, "columns") else [values], strict=True):
        if not converts(column):
            row = next(i for i in range(len(column)) if not converts(column.slice(i, 1)))
            named = f' column "{name}"' if name is not None else ""
            return fail(path, f"row {first_row + row}{named}", f"holds a {column.type} value outside "
                                                               f"Python's range "
                         f"({short(err)}); fix or drop the column, or store it as text")  # fmt: skip
    return fail(path, "", f"cannot be read ({short(err)})")


def converts(values) -> bool:
    try:
        values.to_pylist()
    except (UnicodeDecodeError, OverflowError, ValueError):
        return False
    return True
