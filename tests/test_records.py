"""DATA_PATH's sources, streamed: every format gives the same records and texts; bad files are
one line naming the file."""

import gzip
import json

import pytest

from conftest import make_text
from data_tools import write_arrow_folder, write_jsonl, write_parquet
from train.core.errors import UsageError
from train.data import records

ROWS = [{"text": f"document {i}\nsecond line {i}", "id": i} for i in range(2500)]


def texts(path, field="text"):
    """Whole documents back from iter_texts' pieces."""
    docs, current = [], []
    for piece in records.iter_texts(path, field):
        if piece == "":
            docs.append("".join(current))
            current = []
        else:
            current.append(piece)
    assert not current
    return docs


def test_every_record_format_gives_the_same_records(tmp_path):
    want = [row["text"] for row in ROWS]
    jsonl = write_jsonl(tmp_path / "a.jsonl", ROWS)
    gz = tmp_path / "a.jsonl.gz"
    gz.write_bytes(gzip.compress(jsonl.read_bytes()))
    as_list = tmp_path / "a.json"
    as_list.write_text(json.dumps(ROWS))
    parquet = write_parquet(tmp_path / "a.parquet", ROWS, row_group_rows=700)
    arrow = write_arrow_folder(tmp_path / "saved", ROWS)
    for path in (jsonl, gz, as_list, parquet, arrow):
        got = list(records.iter_records(path))
        assert [r for _, r in got] == ROWS, path
        assert texts(path) == want, path
    assert list(records.iter_records(parquet))[1000][0] == "row 1001"
    assert list(records.iter_records(jsonl))[1000][0] == "line 1001"
    assert list(records.iter_records(as_list))[0][0] == "record 1"


def test_arrow_ipc_file_format_and_column_only_reads(tmp_path):
    import pyarrow as pa

    table = pa.Table.from_pylist(ROWS[:10])
    with pa.OSFile(str(tmp_path / "f.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    assert texts(tmp_path / "f.arrow") == [row["text"] for row in ROWS[:10]]
    # Only TEXT_FIELD is read: another column of another type is never converted.
    write_parquet(tmp_path / "b.parquet", [{"body": "x y", "n": [1, 2]}, {"body": None, "n": []}])
    assert texts(tmp_path / "b.parquet", "body") == ["x y"]  # null rows are skipped


def test_text_files_stream_in_the_same_pieces_as_the_whole_text(tmp_path, monkeypatch):
    monkeypatch.setattr(records, "BLOCK_BYTES", 1000)  # many blocks, cuts across them
    text = make_text(3, 9000) + "é" * 3000 + "x" * 200_000 + " tail\n"
    path = tmp_path / "a.md"
    path.write_text(text)
    pieces = list(records.iter_texts(path))
    assert pieces[-1] == "" and "".join(pieces) == text
    assert pieces[:-1] == list(records.split_document(text))
    assert max(len(p) for p in pieces) <= records.CHUNK_CHARS + 200_000
    (tmp_path / "empty.txt").write_text("")
    assert list(records.iter_texts(tmp_path / "empty.txt")) == [""]  # still one (empty) document


def test_folders_and_globs_mix_formats(tmp_path):
    folder = tmp_path / "mixed"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("plain text\n")
    write_jsonl(folder / "b.jsonl", ROWS[:3])
    write_parquet(folder / "sub" / "c.parquet", ROWS[3:5])
    write_arrow_folder(folder / "sub" / "saved", ROWS[5:7])
    (folder / "meta.json").write_text("{}")  # metadata beside data is not data
    (folder / ".hidden").mkdir()
    (folder / ".hidden" / "x.txt").write_text("no")
    found = records.source_files(str(folder))
    assert [p.relative_to(folder).as_posix() for p in found] == [
        "a.txt",
        "b.jsonl",
        "sub/c.parquet",
        "sub/saved",
    ]
    docs = [doc for path in found for doc in texts(path)]
    assert docs == ["plain text\n"] + [row["text"] for row in ROWS[:7]]
    assert records.source_files(str(folder / "**" / "*.parquet")) == [folder / "sub" / "c.parquet"]
    assert records.source_files(str(folder / "sub" / "sav*")) == [folder / "sub" / "saved"]


@pytest.mark.parametrize(
    "make, expect",
    [
        (lambda d: d / "none", "no such file or folder"),
        (lambda d: (d / "empty").mkdir() or d / "empty", "holds no .txt"),
        (lambda d: str(d / "*.parquet"), "matches no"),
    ],
)
def test_missing_sources_name_data_path(tmp_path, make, expect):
    with pytest.raises(UsageError, match=expect) as caught:
        records.source_files(str(make(tmp_path)))
    assert str(caught.value).startswith("DATA_PATH: ") and "\n" not in str(caught.value)


def one_line_error(fn) -> str:
    with pytest.raises(UsageError) as caught:
        fn()
    message = str(caught.value)
    assert "\n" not in message and message.startswith("DATA_PATH: ")
    return message


def test_bad_files_are_one_line_naming_the_file(tmp_path):
    parquet = write_parquet(tmp_path / "p.parquet", [{"prompt": "a", "response": "b"}])
    message = one_line_error(lambda: list(records.iter_texts(parquet, "text")))
    assert 'p.parquet has no column "text"' in message and "prompt, response" in message
    corrupt = tmp_path / "c.parquet"
    corrupt.write_bytes(parquet.read_bytes()[:-30] + b"\0" * 30)
    assert "c.parquet: not a readable parquet file" in one_line_error(
        lambda: list(records.iter_records(corrupt))
    )
    numbers = write_parquet(tmp_path / "n.parquet", [{"text": 1}])
    assert "holds int64, not text" in one_line_error(lambda: list(records.iter_texts(numbers)))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": \n')
    assert "bad.jsonl line 2: not valid JSON" in one_line_error(lambda: list(records.iter_texts(bad)))
    assert [type(r).__name__ for _, r in records.iter_records(bad, keep_bad_lines=True)] == [
        "dict",
        "BadLine",
    ]
    notext = write_jsonl(tmp_path / "q.jsonl", [{"body": "x"}])
    assert 'q.jsonl line 1: expected an object with a "text" string' in one_line_error(
        lambda: list(records.iter_texts(notext))
    )
    latin = tmp_path / "l.txt"
    latin.write_bytes(b"caf\xe9\n")
    assert "l.txt is not UTF-8 text (bad byte at offset 3)" in one_line_error(
        lambda: list(records.iter_texts(latin))
    )
    gz = tmp_path / "g.jsonl.gz"
    gz.write_bytes(gzip.compress(b'{"text": "x"}\n' * 1000)[:40])
    assert "g.jsonl.gz" in one_line_error(lambda: list(records.iter_texts(gz)))
    saved = write_arrow_folder(tmp_path / "saved", ROWS[:2])
    (saved / "state.json").write_text(json.dumps({"_data_files": [{"filename": "../p.parquet"}]}))
    assert "not a file of the folder" in one_line_error(lambda: list(records.iter_records(saved)))
