"""Chat templates rendered within bounds (issue 37): a template that loops, recurses or writes
gigabytes, and a conversation that makes a fair template's renders grow with the square of its
turns, each fail in bounded time as one line: the command (TEMPLATE's check, generate) or the
record (SFT, SKIP_BAD_RECORDS), in the main process and in the tokenizing workers alike."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from suite_control import CpuSpent

from conftest import ROOT, run_cli, train_python

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # fmt: skip
WITH_TOOLS = "{% if tools %}<tools>{{ tools | tojson }}</tools>\n{% endif %}" + CHATML
LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
HOSTILE = {
    "a loop without end": (LOOP, "runs past"),
    "a loop that writes": (
        "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
        "runs past|writes more",
    ),
    "a string multiplied": ("{{ 'x' * 10**10 }}", "writes more"),
    "a huge power": ("{{ 10 ** 100000000 }}", "too large"),
    "a filter's width": ("{{ 'x' | center(10**10) }}", "writes more"),
    "tojson's indent": ("{{ messages | tojson(indent=10**9) }}", "writes more"),
    "recursion": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recurses"),
    "a namespace doubled": (
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
        "{% endfor %}{{ ns.s | length }}",
        "writes more",
    ),
}
PROBE = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]


@pytest.fixture(scope="module")
def tok(base_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(base_model, local_files_only=True)


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_template_fails_in_bounded_time(tok, name):
    from train.data.chat.render_bounds import Budget, RenderFailed, render_chat

    template, reason = HOSTILE[name]
    with CpuSpent() as cpu, pytest.raises(RenderFailed) as err:
        render_chat(tok, PROBE, template=template, budget=Budget(seconds=1.5))
    assert cpu.spent < 10 and re.search(reason, err.value.reason), err.value.reason
    assert render_chat(tok, PROBE, template=CHATML)  # the timer and budget are gone afterwards


def test_a_fair_template_renders_as_transformers_does(tok):
    from train.data.chat.render_bounds import render_chat

    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    turns = [{"role": "system", "content": "Be brief."}, *PROBE, {"role": "user", "content": None}]
    for prompt in (False, True):
        ours = render_chat(tok, turns, tools, prompt, template=WITH_TOOLS)
        theirs = tok.apply_chat_template(turns, tools=tools, chat_template=WITH_TOOLS, tokenize=False,
                                         add_generation_prompt=prompt)  # fmt: skip
        assert ours == theirs


def _sft(
    tmp_path, base_model, cache_dir, records: list[dict], template: str, *flags: str
) -> tuple[int, list[str]]:
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    path = tmp_path / "t.jinja"
    path.write_text(template)
    argv = [train_python(), "-m", "train", "sft", "--model_path", str(base_model), "--data_path", str(data),
            "--template", str(path), "--cache_dir", str(cache_dir), "--output_dir", str(tmp_path / "runs"),
            "--max_length", "64", "--max_steps", "1", "--batch_size", "1", *flags]  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    return done.returncode, [line for line in done.stderr.splitlines() if line.startswith("error")]


def _chat(n: int, words: int = 20) -> dict:
    turns = [{"role": ("user", "assistant")[i % 2], "content": " ".join(["word"] * words)} for i in range(n)]
    return {"messages": turns}


def test_a_looping_template_file_is_refused_at_start(tmp_path, base_model, cache_dir):
    with CpuSpent() as cpu:
        code, errors = _sft(tmp_path, base_model, cache_dir, [_chat(2)], LOOP)
    assert code == 2 and len(errors) == 1, errors
    assert errors[0].startswith("error: TEMPLATE (--template)") and "runs past" in errors[0], errors
    # CPU seconds: a wall bound fails on busy cores
    assert cpu.spent < 90 and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("case", ["turns", "tools"])
def test_a_conversation_of_many_turns_renders_a_few_times_and_trains(tmp_path, base_model, cache_dir, case):
    # 4000 turns; a tools list of 400 kB with 600 turns: rendered twice per trained turn (the
    # square of the turns) these ran past the bound; a bounded number of renders fit it.
    tools = [
        {"type": "function", "function": {"name": f"f{i}", "description": "d" * 400}} for i in range(1000)
    ]
    big = _chat(4000, 4) if case == "turns" else {**_chat(600, 2), "tools": tools}
    with CpuSpent() as cpu:
        code, errors = _sft(tmp_path, base_model, cache_dir, [_chat(2), big], WITH_TOOLS)
    assert code == 0 and not errors, errors
    assert cpu.spent < 120


def test_a_template_that_grows_quadratically_is_a_bad_record(tmp_path, base_model, cache_dir):
    # The tools list (400 kB) written again in each of 600 turns: 240 MB from one render.
    tools = [
        {"type": "function", "function": {"name": f"f{i}", "description": "d" * 400}} for i in range(1000)
    ]
    each_turn = CHATML.replace("{{ m['content'] }}", "{{ m['content'] }}{{ tools | tojson }}")
    with CpuSpent() as cpu:
        code, errors = _sft(
            tmp_path, base_model, cache_dir, [_chat(2), {**_chat(600, 2), "tools": tools}], each_turn
        )
        assert code == 2 and len(errors) == 1, errors
        assert re.search(
            "line 2: cannot be rendered by the chat template: it (writes more than|runs past)", errors[0]
        )
        code, errors = _sft(
            tmp_path,
            base_model,
            cache_dir,
            [_chat(2), {**_chat(600, 2), "tools": tools}],
            each_turn,
            "--skip_bad_records",
        )
        assert code == 0 and not errors, errors  # skipped, the rest trains
    assert cpu.spent < 240  # two runs of a few CPU seconds each


def test_a_record_that_loops_in_a_worker_process_is_a_bad_record(tmp_path, base_model, cache_dir):
    # The tokenizing runs in TOKENIZE_WORKERS processes: the timer works in each one's main thread.
    template = "{% if messages[0]['content'] == 'loop' %}" + LOOP + "{% endif %}" + CHATML
    records = [
        _chat(2),
        {"messages": [{"role": "user", "content": "loop"}, {"role": "assistant", "content": "x"}]},
    ]
    code, errors = _sft(tmp_path, base_model, cache_dir, records, template, "--tokenize_workers", "2")
    assert code == 2 and len(errors) == 1 and "line 2: cannot be rendered" in errors[0], errors
    assert "runs past" in errors[0], errors


def test_a_fifo_as_template_is_one_line(tmp_path, capsys):
    fifo = tmp_path / "t.jinja"
    import os

    os.mkfifo(fifo)
    assert (
        run_cli("sft", "--template", str(fifo), "--output_dir", str(tmp_path / "runs"), "--max_steps", "1")
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: TEMPLATE (--template)"), err
    assert not (tmp_path / "runs").exists()


def test_read_user_file_refuses_what_is_not_a_regular_file(tmp_path):
    import os

    from train.core.errors import UsageError
    from train.core.files import read_user_file

    fifo = tmp_path / "f"
    os.mkfifo(fifo)
    for path, kind in ((fifo, "a FIFO"), (Path("/dev/zero"), "a device"), (tmp_path, "a folder")):
        with pytest.raises(UsageError, match=f"X: {path} is {kind}, not a regular file"):
            read_user_file(path, "X")
    (tmp_path / "big").write_bytes(b"x" * 101)
    with pytest.raises(UsageError, match="101 bytes"):
        read_user_file(tmp_path / "big", "X", limit=100)
