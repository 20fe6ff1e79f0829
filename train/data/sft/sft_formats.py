"""SFT records in the formats users already have -> conversations; plus the built-in default set.

FORMATS is the table of formats, a row each (name, detect, convert); every convert ends in the
one conversation shape of train/data/sft/sft_turns.py (roles system, user, assistant, tool; tool
calls and the tools list included), so the template and the loss mask (train/data/sft/sft_data.py)
see one shape.
Records come from train/data/records.py, streamed, so a .json list, JSONL, parquet and Arrow
rows are all dicts here and read alike. Errors are UsageError with one line that names the file
and the line (JSONL), the 1-based record number (.json) or row (parquet, Arrow), because "bad
record" without a place is useless on a 100k-line file.
"""

from __future__ import annotations

import ast
import itertools
import os
import sysconfig
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from train.core.errors import UsageError
from train.data import records
from train.data.sft.sft_turns import BadRecord, text, turns


@dataclass(frozen=True)
class Format:
    """One SFT format: a row of FORMATS. A new format is a new row."""

    name: str
    keys: str  # what its records carry, for "accepted: ..." messages
    detect: Callable[[dict], bool]
    convert: Callable[[dict], list[dict]]  # a record -> a conversation (sft_turns' shape)


def _alpaca(record: dict) -> list[dict]:
    prompt = text(record["instruction"], "'instruction'")
    extra = text(record.get("input") or "", "'input'")
    if extra.strip():
        prompt = f"{prompt}\n\n{extra}"
    conv = [{"role": "user", "content": prompt}, {"role": "assistant", "content": text(record["output"], "'output'")}]
    if record.get("system"):
        conv.insert(0, {"role": "system", "content": text(record["system"], "'system'")})
    return conv


def _prompt_response(record: dict) -> list[dict]:
    return [
        {"role": "user", "content": text(record["prompt"], "'prompt'")},
        {"role": "assistant", "content": text(record["response"], "'response'")},
    ]


# Detected in this order. Turn lists first: such records may also carry stray "prompt" or
# "instruction" fields.
FORMATS = {
    f.name: f
    for f in (
        Format(
            "messages",
            "messages: [{role, content}], tools",
            lambda r: isinstance(r.get("messages"), list),
            lambda r: turns(r["messages"], "role", "content", r.get("tools")),
        ),
        Format(
            "sharegpt",
            "conversations: [{from, value}], tools",
            lambda r: isinstance(r.get("conversations"), list),
            lambda r: turns(r["conversations"], "from", "value", r.get("tools")),
        ),
        Format("alpaca", "instruction/input/output", lambda r: "instruction" in r and "output" in r, _alpaca),
        Format("prompt_response", "prompt/response", lambda r: "prompt" in r and "response" in r, _prompt_response),
        # A plain document, trained whole (TRL's dataset_text_field): its one turn of role "text".
        Format("text", "text", lambda r: isinstance(r.get("text"), str), lambda r: [{"role": "text", "content": r["text"]}]),
    )
}
ACCEPTED = "; ".join(f"{f.name} ({f.keys})" for f in FORMATS.values())
SOURCES = "a .json list, .jsonl (.jsonl.gz), .parquet or an Arrow (save_to_disk) folder"


def detect_format(record: object) -> str | None:
    """The name of the first format whose keys the record carries, or None."""
    if not isinstance(record, dict):
        return None
    return next((f.name for f in FORMATS.values() if f.detect(record)), None)


def to_conversation(record: dict, fmt: str) -> list[dict]:
    """One record of format `fmt` -> a conversation; raises BadRecord with the reason."""
    if detect_format(record) != fmt:
        keys = ", ".join(sorted(record)) if isinstance(record, dict) else type(record).__name__
        raise BadRecord(f"does not match the file's format {fmt} ({FORMATS[fmt].keys}); has: {keys}")
    conv = FORMATS[fmt].convert(record)
    for i, turn in enumerate(conv, 1):
        # An empty reply would teach the model to end its turn at once; a call is a reply.
        if turn["role"] == "assistant" and not turn["content"].strip() and not turn.get("tool_calls"):
            raise BadRecord(f"no response (assistant turn {i} is empty)")
    # Trailing user, tool and system turns carry no loss and only cost tokens.
    while conv and conv[-1]["role"] not in ("assistant", "text"):
        conv.pop()
    if not conv:
        raise BadRecord("no response (no assistant turn)")
    return conv


def source_records(data_path: str | Path) -> Iterator[tuple[str, object]]:
    """(place, record or a BadRecord) for every record of DATA_PATH: a .json list, JSONL
    (.jsonl.gz), parquet, an Arrow (save_to_disk) folder, or a folder or glob of them, read by
    train/data/records.py, streamed. place names the file and the line, record or row."""
    named = Path(data_path).is_file()  # a file named directly is read as JSON lines whatever its suffix
    for path in records.source_files(str(data_path)):
        if records.is_text_file(path) and not named:
            raise UsageError(f"DATA_PATH: {path}: plain text is for pretraining; SFT reads {SOURCES}")
        for where, record in records.iter_records(path, keep_bad_lines=True):
            place = f"{path} {where}"
            yield place, BadRecord(str(record)) if isinstance(record, records.BadLine) else record


def open_records(data_path: str | Path) -> tuple[str, Iterator[tuple[str, object]]]:
    """(format name, every record of DATA_PATH as (place, record)), streamed.

    The format is the one of the first record that matches one; only the records before it
    (none, usually) are held while it is looked for. An empty source or an unknown format is
    a UsageError naming DATA_PATH."""
    stream = source_records(data_path)
    head: list[tuple[str, object]] = []
    for place, record in stream:
        head.append((place, record))
        if fmt := detect_format(record):
            return fmt, itertools.chain(head, stream)
    if not head:
        raise UsageError(f"DATA_PATH: {data_path}: no records (the file is empty)")
    first = next((r for _, r in head if isinstance(r, dict)), None)
    seen = f"keys: {', '.join(sorted(first)) or 'none'}" if first is not None else "no JSON objects"
    raise UsageError(f"DATA_PATH: {data_path}: unknown SFT format ({seen}); accepted: {ACCEPTED}")


def converted(items, fmt: str) -> tuple[list[list[dict]], list[str]]:
    """Records of format fmt -> (conversations, "place: reason" of each unusable record)."""
    conversations, bad = [], []
    for place, record in items:
        try:
            if isinstance(record, BadRecord):
                raise record
            conversations.append(to_conversation(record, fmt))
        except BadRecord as e:
            bad.append(f"{place}: {e}")
    return conversations, bad


def refuse_bad(first: str) -> UsageError:
    """A bad record stops the run (without SKIP_BAD_RECORDS): one line with its place."""
    return UsageError(f"DATA_PATH: {first} (SKIP_BAD_RECORDS=1 skips such records)")


def all_bad(data_path, skipped: int, first: str) -> UsageError:
    return UsageError(f"DATA_PATH: {data_path}: all {skipped} records are bad; the first: {first}")


def load_conversations(path: Path, skip_bad_records: bool = False) -> tuple[list[list[dict]], str, int]:
    """DATA_PATH -> (conversations, format name, records skipped), all in memory: for small
    data and tests; a run reads through the SFT cache (train/data/sft/sft_cache.py) instead.

    The format is detected from the first record that matches one; every record must then be
    in that format. With skip_bad_records a bad record is counted instead of stopping the run,
    but an empty file, an unknown format, or a file with no good record still stops it.
    """
    fmt, items = open_records(path)
    conversations, bad = converted(items, fmt)
    if bad and not skip_bad_records:
        raise refuse_bad(bad[0])
    if not conversations:
        raise all_bad(path, len(bad), bad[0])
    return conversations, fmt, len(bad)


# --- built-in default: instruction/response pairs mined from the standard library -------------

DEFAULT_BUILTIN_LIMIT = 3000
# Tests, GUI demos, codec tables and vendored code are repetitive or not code worth imitating.
_SKIP_DIRS = {
    "test",
    "tests",
    "idlelib",
    "turtledemo",
    "site-packages",
    "dist-packages",
    "lib2to3",
    "ensurepip",
    "pydoc_data",
    "encodings",
    "__pycache__",
    "__phello__",
    "config-3",
}
# Longer bodies would be cut by MAX_LENGTH anyway, and they dominate the token count.
_MAX_BODY_CHARS = 4000


def _stdlib_files() -> Iterator[Path]:
    root = sysconfig.get_paths()["stdlib"]
    for folder, dirs, files in os.walk(root):
        # In-place sort and prune: os.walk then visits in a fixed order and skips those folders.
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith(("config-", "test")))
        for name in sorted(files):
            if name.endswith(".py") and not name.startswith("test"):
                yield Path(folder, name)


def _summary(doc: str) -> str:
    return " ".join(doc.strip().split("\n\n")[0].split())


def _statements(node: ast.AST) -> Iterator[ast.AST]:
    # Functions are statements, so only statement blocks need visiting; ast.walk also visits
    # every expression node, which made mining three times slower.
    for field in ("body", "orelse", "finalbody", "handlers", "cases"):
        for child in getattr(node, field, None) or ():
            if isinstance(child, ast.AST):
                yield child
                yield from _statements(child)


def _is_stub(stmt: ast.stmt) -> bool:
    # Abstract methods (`pass`, `...`, `raise NotImplementedError`) teach nothing.
    if isinstance(stmt, ast.Pass):
        return True
    if isinstance(stmt, ast.Expr):
        return isinstance(stmt.value, ast.Constant)
    return isinstance(stmt, ast.Raise) and "NotImplementedError" in ast.unparse(stmt)


def _pairs_from_source(source: str) -> Iterator[tuple[str, str]]:
    lines = source.splitlines()
    for node in _statements(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("__"):
            continue
        doc = ast.get_docstring(node)
        body = node.body[1:]
        if not doc or not body or not _summary(doc):
            continue
        if len(body) == 1 and _is_stub(body[0]):
            continue
        start = min([body[0].lineno] + [d.lineno for d in getattr(body[0], "decorator_list", [])])
        code = textwrap.dedent("\n".join(lines[start - 1 : node.end_lineno])).strip("\n")
        if not code.strip() or len(code) > _MAX_BODY_CHARS:
            continue
        prefix = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
        returns = f" -> {ast.unparse(node.returns)}" if node.returns else ""
        signature = f"{prefix} {node.name}({ast.unparse(node.args)}){returns}"
        yield f"Write a Python function `{signature}`: {_summary(doc)}", code


def builtin_conversations(limit: int | None = None) -> list[list[dict]]:
    """SFT pairs mined offline from this Python's standard library: the instruction is a
    function's signature and docstring summary, the response its body without the docstring.

    Deterministic (files and functions in a fixed order) and quick: it stops after `limit`
    records (None = DEFAULT_BUILTIN_LIMIT), so it reads only the first files it needs.
    Response lengths range from one line to pages, as in real SFT data.
    """
    limit = DEFAULT_BUILTIN_LIMIT if limit is None else limit
    conversations: list[list[dict]] = []
    for path in _stdlib_files():
        if len(conversations) >= limit:
            break
        try:
            source = path.read_text(encoding="utf-8")
            pairs = list(_pairs_from_source(source))
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue  # a few stdlib files are Python 2 examples or other encodings
        for instruction, code in pairs:
            conversations.append(
                [{"role": "user", "content": instruction}, {"role": "assistant", "content": code}]
            )
    return conversations[:limit]
