"""The resolved config a run prints (and train.log keeps) says what the run does: MODEL_SIZE as the
plan decided it (`make train` printed "model_size = nano" above a line with MODEL_SIZE= empty),
MODEL_FAMILY of the model trained (a T5 MODEL_PATH showed gpt2: tests/test_dpo_mode.py), and
VAL_FRACTION as unused when VAL_PATH gives the held-out set."""

from __future__ import annotations

import json

from conftest import run_cli


def resolved(out: str, section: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(f"  {section}: "))


def test_the_resolved_config_shows_what_the_run_uses(corpus, cache_dir, base_model, tmp_path, capsys):
    flags = ["--cache_dir", str(cache_dir), "--output_dir", str(tmp_path / "runs"), "--max_length", "64",
             "--max_steps", "1", "--dry_run", "1"]  # fmt: skip
    # no MODEL_SIZE on a machine without a GPU: the plan's nano
    assert run_cli("pretrain", *flags, "--data_path", str(corpus), "--vocab_size", "512") == 0
    out = capsys.readouterr().out
    assert "model_size = nano" in out and " MODEL_SIZE=nano MODEL_FAMILY=gpt2 " in resolved(out, "model")
    assert " VAL_FRACTION=0.01 " in resolved(out, "data")  # used: no VAL_PATH
    data = tmp_path / "chat.jsonl"
    data.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": f"q{i}"},
                        {"role": "assistant", "content": f"a{i}"},
                    ]
                }
            )
            + "\n"
            for i in range(8)
        )
    )
    assert (
        run_cli(
            "sft", *flags, "--model_path", str(base_model), "--data_path", str(data), "--val_path", str(data)
        )
        == 0
    )
    data_line = resolved(capsys.readouterr().out, "data")
    assert " VAL_FRACTION=(unused:VAL_PATH) " in data_line and f" VAL_PATH={data}" in data_line, data_line
