"""Records that cannot fit this model are not bad input (issue 37): LLaMA-Factory's
glaive_toolcall_en_demo.json stopped the first-hour SFT run at `record 4: has a tools list and
system turn that alone fill MAX_LENGTH=256 tokens (raise MAX_LENGTH)`, though glaive records have
no system turn and 256 was already the model's context. Now such a record is skipped and counted
with a warning naming the real cause; the run stops in one line only when most records cannot fit.
The glaive-shaped file is made here (no download)."""

from __future__ import annotations

import json

import pytest
from test_bad_records import train_here

from conftest import TINY_CONFIG, read_jsonl

SMALL_TOOL = {
    "name": "get_time",
    "description": "Get the time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def big_tools(n: int = 30) -> list[dict]:
    return [
        {
            "name": f"lookup_{i}",
            "description": f"Look up record {i} of the archive by its key and its "
            f"year, returning every field the archive keeps for it",
            "parameters": {
                "type": "object",
                "properties": {
                    f"key_{i}": {"type": "string", "description": "the key"},
                    "year": {"type": "integer"},
                },
            },
        }
        for i in range(n)
    ]


def glaive(i: int, tools: list[dict]) -> dict:
    """One record as glaive_toolcall_en_demo.json has it: ShareGPT turns, calls and results, tools as a JSON
    string."""
    call = {"name": tools[0]["name"], "arguments": {"city": f"City {i}"}}
    return {"conversations": [{"from": "human", "value": f"What time is it in City {i}?"},
                              {"from": "function_call", "value": json.dumps(call)},
                              {"from": "observation", "value": json.dumps({"time": f"{i % 12 + 1}:00"})},
                              {"from": "gpt", "value": f"It is {i % 12 + 1} o'clock in City {i}."}],
            "tools": json.dumps(tools)}  # fmt: skip


@pytest.fixture
def world(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**TINY_CONFIG, "n_positions": 256}))
    flags = [
        "--model_config",
        str(config),
        "--vocab_size",
        "512",
        "--max_length",
        "256",
        "--batch_size",
        "2",
        "--max_steps",
        "2",
        "--cache_dir",
        str(tmp_path / "cache"),
        "--output_dir",
        str(tmp_path / "runs"),
        "--tokenize_workers",
        "1",
    ]
    return tmp_path, flags


def test_a_glaive_file_with_one_record_too_long_for_the_model_trains(world, capsys):
    tmp_path, flags = world
    data = tmp_path / "glaive_toolcall_en_demo.json"
    data.write_text(json.dumps([glaive(i, big_tools() if i == 4 else [SMALL_TOOL]) for i in range(1, 13)]))
    result = train_here(capsys, "sft", *flags, "--data_path", str(data), "--run_name", "glaive")
    assert result.returncode == 0, result.stderr[-3000:]
    warning = next(line for line in result.stdout.splitlines() if line.startswith("warning: skipped"))
    assert warning.startswith(f"warning: skipped 1 record(s) that cannot fit this model at MAX_LENGTH=256 "
                              f"(not bad input: the rest train); the first: {data} record 4: cannot fit "
                              f"MAX_LENGTH=256 tokens: "
                              "its tools list alone takes ")  # fmt: skip
    assert "system turn" not in warning and "raise MAX_LENGTH" not in warning
    summary = json.loads((tmp_path / "runs" / "glaive" / "summary.json").read_text())
    assert summary["n_conversations"] == 11 and read_jsonl(tmp_path / "runs" / "glaive" / "metrics.jsonl")


def test_most_records_too_long_for_the_model_stop_the_run_in_one_line(world, capsys):
    tmp_path, flags = world
    data = tmp_path / "tools.jsonl"
    rows = [glaive(i, big_tools() if i % 4 else [SMALL_TOOL]) for i in range(1, 13)]
    rows[1]["system"] = "You are a helpful assistant with tools."  # LLaMA-Factory's system column
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = train_here(capsys, "sft", *flags, "--data_path", str(data), "--run_name", "most")
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[
        -3000:
    ]
    assert lines[0].startswith(
        f"error: DATA_PATH: {data}: 9 of 12 records cannot fit this model at "
        f"MAX_LENGTH=256 (SKIP_BAD_RECORDS=1 trains on the 3 that fit); the first: "
        f"{data} line 1: cannot fit MAX_LENGTH=256 tokens: its tools list alone takes "
    )
    assert not (tmp_path / "runs" / "most").exists()
    # the record with a system turn says so
    from train.data.chat.formats import load_conversations
    from train.data.chat.templates import Tally
    from train.data.text import load_tokenizer

    conversations, _, _ = load_conversations(data)
    (cache,) = (tmp_path / "cache" / "tokenizers").iterdir()
    tok = load_tokenizer(str(cache), [], "", 512, tmp_path / "cache", print)
    from train.data.chat.encode import encode_conversations, ensure_special_tokens

    ensure_special_tokens(tok)
    tally = Tally()
    encode_conversations(conversations[1:2], tok, 256, tally=tally)
    assert "cannot fit MAX_LENGTH=256 tokens: its tools list and system turn take " in tally.unfit[0][1]


def reasoning_tools(i: int, tools: list[dict]) -> dict:
    """A reasoning + tool-call record in the messages format: think, call, read the result, answer."""
    call = {"name": tools[0]["name"], "arguments": {"city": f"City {i}"}}
    return {"tools": tools, "messages": [
        {"role": "user", "content": f"What time is it in City {i}?"},
        {"role": "assistant", "reasoning_content": f"The user asks the time in City {i}; the tool tells it.",
         "content": "", "tool_calls": [{"type": "function", "function": call}]},
        {"role": "tool", "content": json.dumps({"time": f"{i % 12 + 1}:00"})},
        {"role": "assistant", "content": f"It is {i % 12 + 1} o'clock in City {i}."}]}  # fmt: skip


def test_skip_bad_records_trains_on_what_fits_when_most_records_cannot(world, capsys):
    """Round 5: an explicit SKIP_BAD_RECORDS=1 was overruled: 50 reasoning + tool-call records, 40 of
    whose tools lists alone fill the context, stopped with "40 of 50 records cannot fit" (exit 2).
    The user asked for the skip: the 10 that fit train, and the run says loudly how many did not."""
    tmp_path, flags = world
    data = tmp_path / "reasoning_tools.jsonl"
    rows = [reasoning_tools(i, [SMALL_TOOL] if i % 5 == 0 else big_tools()) for i in range(50)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    refused = train_here(capsys, "sft", *flags, "--data_path", str(data), "--run_name", "no_skip")
    assert (
        refused.returncode == 2
        and "40 of 50 records cannot fit this model at MAX_LENGTH=256 (SKIP_BAD_RECORDS=1 "
        "trains on the 10 that fit)"
        in refused.stderr
    ), refused.stderr[-2000:]
    result = train_here(
        capsys, "sft", *flags, "--data_path", str(data), "--skip_bad_records", "1", "--run_name", "skip"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    warning = next(line for line in result.stdout.splitlines() if "cannot fit this model" in line)
    assert warning.startswith("warning: SKIP_BAD_RECORDS=1: skipped 40 of 50 records (80%) that cannot fit "
                              "this model at MAX_LENGTH=256; only the 10 that fit train"), warning
    summary = json.loads((tmp_path / "runs" / "skip" / "summary.json").read_text())
    assert summary["n_conversations"] == 10 and summary["exit_reason"] == "completed"
    assert not (tmp_path / "runs" / "no_skip").exists()
