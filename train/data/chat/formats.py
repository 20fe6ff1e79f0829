"""SFT records in the formats users already have -> conversations; plus the built-in default set.

FORMATS is the table of formats, a row each (name, detect, convert); every convert ends in the
one conversation shape of train/data/chat/turns.py (roles system, user, assistant, tool; tool
calls, reasoning, loss weights and the tools list included), so the template and the loss mask
(train/data/chat/encode.py) see one shape. A record with TEXT_FIELD and no turns is plain text,
trained whole; that format's name carries the field when it is not "text" ("text:body"), so the
name alone says how to read a record, in the cache's worker processes too.
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
from functools import partial
from pathlib import Path

from train.core.errors import UsageError
from train.data import records
from train.data.chat.turns import TEXT_ROLE, TOOLS_ROLE, BadRecord, all_bad, refuse_bad, text, turns

TEXT_FIELD = "text"  # DataConfig.text_field's default


@dataclass(frozen=True)
class Format:
    """One SFT format: a row of FORMATS. A new format is a new row."""

    name: str
    keys: str  # what its records carry, for "accepted: ..." messages ({field}: TEXT_FIELD)
    detect: Callable[[dict, str], bool]  # (record, TEXT_FIELD) -> its format?
    convert: Callable[[dict, str], list[dict]]  # (record, TEXT_FIELD) -> a conversation (turns' shape)


def _with_system(record: dict, conv: list[dict]) -> list[dict]:
    """A record-level "system" (LLaMA-Factory's alpaca and ShareGPT columns) as the first turn."""
    if record.get("system") and not any(turn["role"] == "system" for turn in conv):
        # after the tools list, which opens a conversation
        at = 1 if conv and conv[0]["role"] == TOOLS_ROLE else 0
        conv.insert(at, {"role": "system", "content": text(record["system"], "'system'")})
    return conv


def _alpaca(record: dict, _field: str) -> list[dict]:
    prompt = text(record["instruction"], "'instruction'")
    extra = text(record.get("input") or "", "'input'")
    if extra.strip():  # one newline between them, as LLaMA-Factory's AlpacaDatasetConverter joins them
        prompt = f"{prompt}\n{extra}"
    conv = []  # LLaMA-Factory's "history": [[instruction, response], ...] turns before this one, trained too
    history = record.get("history") or []
    if not isinstance(history, list) or not all(
        isinstance(h, (list, tuple)) and len(h) == 2 for h in history
    ):
        raise BadRecord("'history' is not a list of [instruction, response] pairs")
    for i, (asked, answered) in enumerate(history, 1):
        conv += [{"role": "user", "content": text(asked, f"'history' pair {i}")},
                 {"role": "assistant", "content": text(answered, f"'history' pair {i}")}]  # fmt: skip
    conv += [
        {"role": "user", "content": prompt},
        {"role": "assistant", "content": text(record["output"], "'output'")},
    ]
    return _with_system(record, conv)


def _prompt_response(record: dict, _field: str) -> list[dict]:
    return [
        {"role": "user", "content": text(record["prompt"], "'prompt'")},
        {"role": "assistant", "content": text(record["response"], "'response'")},
    ]


def _prompt_completion(record: dict, _field: str) -> list[dict]:
    """TRL's prompt-completion records: two strings, or two lists of messages (its conversational form)."""
    prompt, completion = record["prompt"], record["completion"]
    if isinstance(prompt, list) and isinstance(completion, list):
        return turns(prompt + completion, "role", "content", record.get("tools"))
    return [{"role": "user", "content": text(prompt, "'prompt'")},
            {"role": "assistant", "content": text(completion, "'completion'")}]  # fmt: skip


def _plain_text(record: dict, field: str) -> list[dict]:
    content = text(record[field], f"'{field}' (TEXT_FIELD)")
    if not content.strip():
        raise BadRecord(f"'{field}' (TEXT_FIELD) is empty")
    return [{"role": TEXT_ROLE, "content": content}]


# Detected in this order. Turn lists first: such records may also carry stray "prompt" or
# "instruction" fields; plain text last, so a record with turns and a "text" field is a conversation.
FORMATS = {
    f.name: f
    for f in (
        Format(
            "messages",
            "messages: [{role, content}], tools",
            lambda r, _: isinstance(r.get("messages"), list),
            lambda r, _: _with_system(r, turns(r["messages"], "role", "content", r.get("tools"))),
        ),
        Format(
            "sharegpt",
            "conversations: [{from, value}], tools",
            lambda r, _: isinstance(r.get("conversations"), list),
            lambda r, _: _with_system(r, turns(r["conversations"], "from", "value", r.get("tools"))),
        ),
        Format(
            "alpaca", "instruction/input/output", lambda r, _: "instruction" in r and "output" in r, _alpaca
        ),
        Format(
            "prompt_response",
            "prompt/response",
            lambda r, _: "prompt" in r and "response" in r,
            _prompt_response,
        ),
        Format(
            "prompt_completion",
            "prompt/completion (TRL)",
            lambda r, _: "prompt" in r and "completion" in r,
            _prompt_completion,
        ),
        Format("text", "{field} = TEXT_FIELD, trained whole", lambda r, field: field in r, _plain_text),
    )
}
SOURCES = "a .json list, .jsonl (.jsonl.gz), .parquet or an Arrow (save_to_disk) folder"


def accepted(text_field: str = TEXT_FIELD) -> str:
    """The formats, for "accepted: ..." messages."""
    return "; ".join(f"{f.name} ({f.keys.replace('{field}', text_field)})" for f in FORMATS.values())


def open_table(
    data_path: str | Path, what: str, table: dict, skip_bad_records: bool,
    hint: Callable[[dict | None], str] = lambda first: "",
) -> tuple[str, Iterator[tuple[str, object]]]:
    """(format name, every record of DATA_PATH as (place, record)), streamed, for a door with its own table
    of formats (preference pairs, prompts); the format is the first matching record's (first_format). An
    empty source or an unknown format is one line naming DATA_PATH; hint(first record): a door's pointer."""
    stream = source_records(data_path)
    fmt, head = first_format(stream, partial(first_match, table), skip_bad_records)
    if fmt:
        return fmt, itertools.chain(head, stream)
    if not head:
        raise UsageError(f"DATA_PATH: {data_path}: no records (the file is empty)")
    first = next((r for _, r in head if isinstance(r, dict)), None)
    seen = f"keys: {', '.join(sorted(first)) or 'none'}" if first is not None else "no JSON objects"
    raise UsageError(f"DATA_PATH: {data_path}: unknown {what} format ({seen}){hint(first)}; accepted: "
                     f"{listed(table)}")


def listed(table: dict) -> str:
    """A table of formats (the preference and prompt doors' own), for "accepted: ..." messages."""
    return "; ".join(f"{f.name} ({f.keys})" for f in table.values())


def first_match(table: dict, record: object) -> str | None:
    """The name of the table's first format whose keys the record carries, or None."""
    if not isinstance(record, dict):
        return None
    return next((f.name for f in table.values() if f.detect(record)), None)


def _read_as(fmt: str) -> tuple[Format, str]:
    """A format name -> (its row, TEXT_FIELD): "text:body" is the text row reading "body"."""
    name, _, field = fmt.partition(":")
    return FORMATS[name], field or TEXT_FIELD


def detect_format(record: object, text_field: str = TEXT_FIELD) -> str | None:
    """The name of the first format whose keys the record carries, or None."""
    if not isinstance(record, dict):
        return None
    name = next((f.name for f in FORMATS.values() if f.detect(record, text_field)), None)
    return f"{name}:{text_field}" if name == "text" and text_field != TEXT_FIELD else name


def _trained(turn: dict) -> bool:
    """Does the loss count on this turn by default? A loss_weight the source gave decides."""
    weight = turn.get("loss_weight")
    return weight > 0 if weight is not None else turn["role"] in ("assistant", TEXT_ROLE)


def to_conversation(record: dict, fmt: str) -> list[dict]:
    """One record of format `fmt` -> a conversation; raises BadRecord with the reason."""
    row, field = _read_as(fmt)
    if detect_format(record, field) != fmt:
        keys = ", ".join(sorted(record)) if isinstance(record, dict) else type(record).__name__
        raise BadRecord(f"does not match the file's format {fmt} ({row.keys.replace('{field}', field)}); "
                        f"has: {keys}")
    conv = row.convert(record, field)
    for i, turn in enumerate(conv, 1):
        # An empty reply would teach the model to end its turn at once; a call or a thinking trace
        # is a reply. (Turn lists say so turn by turn in turns.py, with what their parts held.)
        if turn["role"] == "assistant" and not (
            turn["content"].strip() or turn.get("tool_calls") or turn.get("reasoning_content")
        ):
            raise BadRecord(f"no response (assistant turn {i} is empty)")
    if not any(_trained(turn) for turn in conv):
        if any(turn["role"] == "assistant" for turn in conv):
            raise BadRecord("nothing to train (every assistant turn has loss_weight 0)")
        raise BadRecord("no response (no assistant turn)")
    # Trailing turns the loss skips (user, tool, system; loss_weight 0) only cost tokens.
    while not _trained(conv[-1]):
        conv.pop()
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


def first_format(
    stream: Iterator[tuple[str, object]], detect, skip_bad_records: bool
) -> tuple[str | None, list]:
    """(the format detect finds in the first record it matches, or None; the records read up to it),
    the rest left in stream. Without skip_bad_records a bad record met on the way stops here, as
    it would later (a line over MAX_RECORD_MB in a .jsonl.gz is not read past: gigabytes to
    decompress before the error)."""
    head: list[tuple[str, object]] = []
    for place, record in stream:
        if isinstance(record, BadRecord) and not skip_bad_records:
            raise refuse_bad(f"{place}: {record}")
        head.append((place, record))
        if fmt := detect(record):
            return fmt, head
    return None, head


def open_records(data_path: str | Path, text_field: str = TEXT_FIELD,
                 skip_bad_records: bool = True) -> tuple[str, Iterator[tuple[str, object]]]:
    """(format name, every record of DATA_PATH as (place, record)), streamed.

    The format is the one of the first record that matches one; only the records before it
    (none, usually) are held while it is looked for. An empty source or an unknown format is
    a UsageError naming DATA_PATH. text_field: TEXT_FIELD, which a plain-text record trains on;
    skip_bad_records: first_format's."""
    stream = source_records(data_path)
    fmt, head = first_format(stream, partial(detect_format, text_field=text_field), skip_bad_records)
    if fmt:
        return fmt, itertools.chain(head, stream)
    if not head:
        raise UsageError(f"DATA_PATH: {data_path}: no records (the file is empty)")
    bad = next(((place, r) for place, r in head if isinstance(r, BadRecord)), None)
    if bad is not None and all(isinstance(r, BadRecord) for _, r in head):  # a line over MAX_RECORD_MB ...
        raise refuse_bad(f"{bad[0]}: {bad[1]}")
    first = next((r for _, r in head if isinstance(r, dict)), None)
    seen = f"keys: {', '.join(sorted(first)) or 'none'}" if first is not None else "no JSON objects"
    raise UsageError(f"DATA_PATH: {data_path}: unknown SFT format ({seen}); accepted: {accepted(text_field)}")


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


def load_conversations(path: Path, skip_bad_records: bool = False,
                       text_field: str = TEXT_FIELD) -> tuple[list[list[dict]], str, int]:
    """DATA_PATH -> (conversations, format name, records skipped), all in memory: for small
    data and tests; a run reads through the SFT cache (train/data/chat/conversation_cache.py) instead.

    The format is detected from the first record that matches one; every record must then be
    in that format. With skip_bad_records a bad record is counted instead of stopping the run,
    but an empty file, an unknown format, or a file with no good record still stops it.
    """
    fmt, items = open_records(path, text_field, skip_bad_records)
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
