"""REPORT_TO=tensorboard: rows and the summary written as events, read back with TensorBoard's reader."""

from __future__ import annotations

import importlib.util

import pytest

from train.config.flags import parse_training_args
from train.core.errors import UsageError
from train.observe.tensorboard_log import NoLog, TensorBoardLog, reporter


def _read(path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_rows_and_summary_read_back(tmp_path):
    log = reporter("tensorboard", tmp_path / "run")
    assert isinstance(log, TensorBoardLog)
    rows = [
        {"step": 1, "samples": 8, "loss": 5.5, "lr": 1e-4, "grad_norm": 2.0, "data_wait_frac": None},
        {"step": 2, "samples": 16, "loss": 4.25, "lr": 2e-4, "grad_norm": 1.5, "data_wait_frac": 0.1},
        {"step": 2, "samples": 16, "val_loss": 4.5, "val_ppl": 90.0},
        {"step": 3, "samples": 24, "loss": 3.0, "lr": 3e-4, "grad_norm": 1.0, "data_wait_frac": 0.05},
    ]
    for row in rows:
        log.row(row)
    log.summary({"steps": 3, "samples_per_sec": 12.5, "final_loss": 3.0, "mfu": None, "input_bound": False,
                 "device": "cpu", "estimate_mb": {"peak": 1.0}})
    log.close()
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    acc = _read(tmp_path / "run" / "tensorboard")
    scalars = set(acc.Tags()["scalars"])
    assert {
        "train/loss",
        "train/lr",
        "train/samples",
        "val/loss",
        "val/ppl",
        "summary/samples_per_sec",
    } <= scalars
    assert (
        "train/step" not in scalars and "summary/mfu" not in scalars and "summary/input_bound" not in scalars
    )

    def points(tag):
        return [(e.step, pytest.approx(e.value, rel=1e-6)) for e in acc.Scalars(tag)]

    assert points("train/loss") == [(1, 5.5), (2, 4.25), (3, 3.0)]
    assert points("train/lr") == [(1, 1e-4), (2, 2e-4), (3, 3e-4)]
    assert points("train/data_wait_frac") == [(2, 0.1), (3, 0.05)]  # None rows leave no point
    assert points("val/loss") == [(2, 4.5)]
    assert points("summary/samples_per_sec") == [(3, 12.5)]
    assert points("summary/final_loss") == [(3, 3.0)]
    text = acc.Tensors("summary/text_summary")
    assert text and b"samples_per_sec" in text[0].tensor_proto.string_val[0]


def test_none_writes_nothing_and_bad_values_name_the_variable(tmp_path, monkeypatch):
    log = reporter("none", tmp_path / "run")
    assert isinstance(log, NoLog)
    log.row({"step": 1, "loss": 1.0})
    log.summary({})
    log.close()
    assert not (tmp_path / "run").exists()
    with pytest.raises(UsageError, match=r"REPORT_TO \(--report_to\): expected none \| tensorboard, got "
                                         r"'wandb'"):
        parse_training_args("pretrain", ["--report_to", "wandb"])
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a)
    )
    with pytest.raises(UsageError, match="REPORT_TO=tensorboard: the tensorboard package is not installed"):
        parse_training_args("pretrain", ["--report_to", "tensorboard"])
