"""PACKING=1 and REPORT_TO=tensorboard in real SFT runs of the tiny base model."""

from __future__ import annotations

import json

import pytest

from conftest import read_jsonl, run_cli


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.fixture
def mixed(tmp_path):
    """Alpaca records from a few tokens to most of MAX_LENGTH."""
    records = [
        {"instruction": f"Item {i}.", "input": "", "output": "fox " * (1 + (i * 7) % 10) if i % 4 else "ok"}
        for i in range(96)
    ]
    return write_jsonl(tmp_path / "alpaca.jsonl", records)


def test_packing_fills_rows_and_trains(base_model, mixed, tmp_path, capsys):
    common = ["--model_path", str(base_model), "--output_dir", str(tmp_path / "runs"), "--data_path", mixed,
              "--max_length", "64", "--batch_size", "4", "--max_steps", "3", "--log_every", "1"]
    assert run_cli("sft", *common, "--run_name", "plain") == 0
    assert (
        run_cli("sft", *common, "--packing", "1", "--report_to", "tensorboard", "--run_name", "packed") == 0
    )
    out = capsys.readouterr().out
    assert "packed attention: varlen_sdpa" in out and "no (T x T) mask" in out  # the log names the path
    plain = json.loads((tmp_path / "runs/plain/summary.json").read_text())
    packed = json.loads((tmp_path / "runs/packed/summary.json").read_text())
    assert packed["packing"] is True and packed["attention"] == "varlen_sdpa"
    assert packed["packed_rows"] < 96 * 0.5  # several conversations per row
    assert packed["padding_efficiency"] > max(0.9, plain["padding_efficiency"] + 0.05)
    assert packed["samples"] > plain["samples"]  # conversations counted, not rows
    rows = [r for r in read_jsonl(tmp_path / "runs/packed/metrics.jsonl") if "loss" in r]
    assert len(rows) == 3 and all(r["loss"] == r["loss"] for r in rows)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "runs/packed/tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3]
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx([r["loss"] for r in rows])


def test_packing_with_token_budget_is_refused(base_model, mixed, tmp_path, capsys, monkeypatch):
    """Refused with the other settings (config validation), before the model or data load."""
    import train.models.load

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(train.models.load, "load_pretrained", no_load)
    argv = ["--model_path", str(base_model), "--output_dir", str(tmp_path / "runs"), "--data_path", mixed,
            "--max_length", "64", "--packing", "1", "--token_budget", "256", "--run_name", "x"]
    assert run_cli("sft", *argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: PACKING=1 (--packing) and TOKEN_BUDGET") and len(err.splitlines()) == 1, err
    assert not (tmp_path / "runs" / "x").exists()
