"""REPORT_TO=tensorboard: the run's metrics rows and final summary, mirrored as TensorBoard events.

metrics.jsonl stays the record; this only copies it where `tensorboard --logdir runs` shows
curves live and side by side across runs. Events go to runs/<name>/tensorboard/. Rows are the
dicts the loop writes (a "step" and numbers); training figures become train/<key>,
validation ones (val_loss, val_ppl) val/<key>, and the summary's numbers summary/<key> at the
final step, with the whole summary as a text table.
"""

from __future__ import annotations

import json
import math
from numbers import Real
from pathlib import Path

from train.core.files import LinkRefused

SUBDIR = "tensorboard"


def _numbers(row: dict) -> dict[str, float]:
    """The entries a scalar plot can show: real numbers (bools and None left out)."""
    return {k: float(v) for k, v in row.items() if isinstance(v, Real) and not isinstance(v, bool)}


def _tag(key: str) -> str:
    return f"val/{key[4:]}" if key.startswith("val_") else f"train/{key}"


class TensorBoardLog:
    """SummaryWriter under <run>/tensorboard/. row(dict) per metrics row, summary(dict) once."""

    def __init__(self, run_path: str | Path):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package (config.py checks)

        self.path = Path(run_path) / SUBDIR
        if self.path.is_symlink():  # the writer would put its events wherever the link points
            raise LinkRefused(self.path)
        self.writer = SummaryWriter(log_dir=str(self.path))
        self.last_step = 0

    def row(self, row: dict) -> None:
        step = int(row["step"])
        self.last_step = max(self.last_step, step)
        for key, value in _numbers(row).items():
            if key != "step":
                self.writer.add_scalar(_tag(key), value, step)

    def summary(self, summary: dict) -> None:
        step = int(summary.get("steps") or self.last_step)
        for key, value in _numbers(summary).items():
            if math.isfinite(value):  # a NaN summary figure is "not measured", not a point to plot
                self.writer.add_scalar(f"summary/{key}", value, step)
        flat = {k: v for k, v in summary.items() if not isinstance(v, dict | list)}
        table = "| setting | value |\n|---|---|\n" + "\n".join(
            f"| {k} | {json.dumps(v, default=str)} |" for k, v in flat.items()
        )
        self.writer.add_text("summary", table, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class NoLog:
    """REPORT_TO=none: the same calls, nothing written."""

    path = None

    def row(self, row: dict) -> None:
        pass

    def summary(self, summary: dict) -> None:
        pass

    def close(self) -> None:
        pass


def reporter(report_to: str, run_path: str | Path) -> TensorBoardLog | NoLog:
    """REPORT_TO (validated in config.py) -> the object the run mirrors its rows to; only the
    main process asks (the others hold no run folder)."""
    return TensorBoardLog(run_path) if report_to == "tensorboard" else NoLog()
