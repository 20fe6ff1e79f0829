"""Bad input through the launchers: exit code 2, one line naming the problem, no traceback,
and no existing run folder touched."""

import hashlib
import json
import subprocess

import pytest

from conftest import launch, run_cli


def snapshot(folder):
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def world(tmp_path, corpus, tiny_config, cache_dir):
    """An output folder holding one earlier run, and some bad files."""
    runs = tmp_path / "runs"
    keep = runs / "keep"
    keep.mkdir(parents=True)
    (keep / "summary.json").write_text(json.dumps({"mode": "pretrain", "final_loss": 1.23}))
    (keep / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    files = tmp_path / "files"
    files.mkdir()
    (files / "empty.txt").write_text("")
    (files / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1") * 50)
    (files / "bad.jsonl").write_text('{"text": "fine"}\n{"text": oops}\n')
    (files / "notext.jsonl").write_text('{"body": "no text field"}\n')
    (files / "emptydir").mkdir()
    base = {
        "MODEL_CONFIG": str(tiny_config),
        "DATA_PATH": str(corpus),
        "VOCAB_SIZE": "512",
        "CACHE_DIR": str(cache_dir),
        "OUTPUT_DIR": str(runs),
        "MAX_LENGTH": "64",
        "MAX_STEPS": "2",
    }
    return {"runs": runs, "files": files, "base": base}


CASES = [
    ("BATCH_SIZE=abc", {"BATCH_SIZE": "abc"}, "BATCH_SIZE"),
    ("BATCH_SIZE=0", {"BATCH_SIZE": "0"}, "BATCH_SIZE"),
    ("BATCH_SIZE=-3", {"BATCH_SIZE": "-3"}, "BATCH_SIZE"),
    ("GRADIENT_ACCUM=-1", {"GRADIENT_ACCUM": "-1"}, "GRADIENT_ACCUM"),
    ("GRADIENT_ACCUM=1.5", {"GRADIENT_ACCUM": "1.5"}, "GRADIENT_ACCUM"),
    ("MAX_LENGTH=1", {"MAX_LENGTH": "1"}, "MAX_LENGTH"),
    ("MAX_LENGTH too long", {"MAX_LENGTH": "100000"}, "MAX_LENGTH"),
    ("MODEL_SIZE=huge", {"MODEL_SIZE": "huge", "MODEL_CONFIG": ""}, "MODEL_SIZE"),
    ("MODEL_CONFIG missing", {"MODEL_CONFIG": "/no/such/config.json"}, "MODEL_CONFIG"),
    ("NUM_WORKERS=-2", {"NUM_WORKERS": "-2"}, "NUM_WORKERS"),
    ("LEARNING_RATE=fast", {"LEARNING_RATE": "fast"}, "LEARNING_RATE"),
    ("LEARNING_RATE=0", {"LEARNING_RATE": "0"}, "LEARNING_RATE"),
    ("DROPOUT=-1", {"DROPOUT": "-1"}, "DROPOUT"),
    ("DROPOUT=1.5", {"DROPOUT": "1.5"}, "DROPOUT"),
    ("DROPOUT=abc", {"DROPOUT": "abc"}, "DROPOUT"),
    ("MAX_STEPS=0", {"MAX_STEPS": "0"}, "MAX_STEPS"),
    ("EPOCHS=abc", {"EPOCHS": "abc"}, "EPOCHS"),
    ("PRECISION=fp8", {"PRECISION": "fp8"}, "PRECISION"),
    ("ENABLE_FP16=maybe", {"ENABLE_FP16": "maybe"}, "ENABLE_FP16"),
    ("fp16 and bf16", {"ENABLE_FP16": "1", "ENABLE_BF16": "1"}, "ENABLE_FP16"),
    ("PIN_MEMORY=sure", {"PIN_MEMORY": "sure"}, "PIN_MEMORY"),
    ("DEVICE=cuda without GPU", {"DEVICE": "cuda"}, "DEVICE"),
    ("DEVICE=tpu", {"DEVICE": "tpu"}, "DEVICE"),
    ("RUN_NAME with shell", {"RUN_NAME": "x; touch pwned"}, "RUN_NAME"),
    ("RUN_NAME path", {"RUN_NAME": "../keep"}, "RUN_NAME"),
    ("RUN_NAME exists", {"RUN_NAME": "keep"}, "RUN_NAME"),
    ("DATA_PATH missing", {"DATA_PATH": "/no/such/data.txt"}, "DATA_PATH"),
    ("DATA_PATH empty file", {"DATA_PATH": "{files}/empty.txt"}, "DATA_PATH"),
    ("DATA_PATH not UTF-8", {"DATA_PATH": "{files}/latin1.txt"}, "DATA_PATH"),
    ("DATA_PATH bad JSONL", {"DATA_PATH": "{files}/bad.jsonl"}, "line 2"),
    ("DATA_PATH JSONL without text", {"DATA_PATH": "{files}/notext.jsonl"}, "text"),
    ("DATA_PATH empty folder", {"DATA_PATH": "{files}/emptydir"}, "DATA_PATH"),
    ("TOKENIZER_PATH missing", {"TOKENIZER_PATH": "/no/such/tokenizer"}, "TOKENIZER_PATH"),
    ("too little data for a step", {"BATCH_SIZE": "4096"}, "DATA_PATH"),
]


# Refused once the run has started (the plan reads the data, the tokenizer, the model): the same
# command in this process, torch already imported (5 s a case less); the launcher's mapping of
# variables to flags is the same for every case, and the cases above go through it.
IN_PROCESS = {"MAX_LENGTH too long", "MODEL_SIZE=huge", "MODEL_CONFIG missing", "DEVICE=cuda without GPU",
              "RUN_NAME exists", "DATA_PATH missing", "DATA_PATH empty file", "DATA_PATH not UTF-8",
              "DATA_PATH bad JSONL", "DATA_PATH JSONL without text", "DATA_PATH empty folder",
              "TOKENIZER_PATH missing", "too little data for a step"}  # fmt: skip


def run_here(env: dict, capsys) -> subprocess.CompletedProcess:
    flags = [x for name, value in env.items() for x in (f"--{name.lower()}", value)]
    code = run_cli("pretrain", "--preset", "baseline", "--launcher", "run_single_gpu", *flags)
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess([], code, out, err)


@pytest.mark.parametrize("label, env, expect", CASES, ids=[c[0] for c in CASES])
def test_bad_input(world, label, env, expect, capsys):
    before = snapshot(world["runs"])
    env = {k: v.replace("{files}", str(world["files"])) for k, v in env.items()}
    both = {**world["base"], **env}
    result = run_here(both, capsys) if label in IN_PROCESS else launch("run_single_gpu.sh", both)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, (label, result.stderr[-1500:])
    assert len(lines) == 1, (label, result.stderr[-1500:])
    assert expect in lines[0] and lines[0].startswith("error: ")
    assert "Traceback" not in result.stderr + result.stdout
    assert snapshot(world["runs"]) == before
    assert sorted(p.name for p in world["runs"].iterdir()) == ["keep"]
    assert not (world["files"] / "pwned").exists()
