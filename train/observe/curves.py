"""Training curves from a run folder's metrics.jsonl: loss and samples/s against samples seen.

Reporting code: reads run folders, never imports the loop. Plots use matplotlib's object API
(Figure + Agg canvas) rather than pyplot, so nothing global changes in the caller's process
(no backend switch, no open figures to leak when the loop calls this at the end of a run).
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

from train.core import files

# A long run logs tens of thousands of rows; more points than pixels only costs time.
MAX_POINTS = 2000


REWARD_PANEL = ("reward", "completions/mean_length")  # TRL's names, as reward training logs them


def read_metrics(path: Path) -> list[dict]:
    """Rows of a metrics.jsonl, skipping blank, truncated or non-object lines.

    A run killed mid-write leaves a half line at the end; that must not hide the rest.
    A missing file gives no rows.
    """
    rows: list[dict] = []
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                if isinstance(row, dict):
                    rows.append(row)
    except OSError:
        return []
    return rows


def as_number(value) -> float | None:
    """A finite-or-not float from a JSON value, or None for null, bools, strings and the like."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def x_key(rows: list[dict]) -> str:
    """Plot against samples seen (comparable across batch sizes); fall back to step."""
    return "samples" if any(as_number(r.get("samples")) is not None for r in rows) else "step"


def series(rows: list[dict], key: str, xkey: str) -> tuple[list[float], list[float]]:
    """(x, y) for the rows that carry both numbers, thinned to at most MAX_POINTS."""
    xs: list[float] = []
    ys: list[float] = []
    for row in rows:
        x, y = as_number(row.get(xkey)), as_number(row.get(key))
        if x is None or y is None or not math.isfinite(x):
            continue
        xs.append(x)
        ys.append(y)
    stride = max(1, math.ceil(len(xs) / MAX_POINTS))
    if stride > 1:
        # Keep the last point: the final loss is the one people read off the chart.
        xs, ys = xs[::stride] + xs[-1:], ys[::stride] + ys[-1:]
    return xs, ys


def dots(xs: list) -> dict:
    """Markers for short series: a run with few log lines (8 optimizer steps at LOG_EVERY=10 is one
    row) would otherwise draw an invisible one-point line."""
    return {"marker": "o", "ms": 3} if len(xs) < 30 else {}


def x_label(xkey: str) -> str:
    return "samples seen" if xkey == "samples" else "optimizer step"


def plot_curves(run_dir: Path) -> Path | None:
    """Write run_dir/curves.png (loss, and val loss where logged, plus samples/s, against
    samples seen) and return its path; None when there is nothing to plot.

    Never raises: it runs at the end of training and a chart must not turn a finished run
    into a failed one.
    """
    try:
        return _plot_curves(Path(run_dir))
    except Exception:
        return None


def _plot_curves(run_dir: Path) -> Path | None:
    rows = read_metrics(run_dir / "metrics.jsonl")
    if not rows:
        return None
    xkey = x_key(rows)
    loss_x, loss_y = series(rows, "loss", xkey)
    val_x, val_y = series(rows, "val_loss", xkey)
    sps_x, sps_y = series(rows, "samples_per_sec", xkey)
    if not (loss_x or val_x or sps_x):
        return None

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # Fixed margins, not layout="constrained": that lays the figure out by drawing it once more, 0.44 s of a
    # 0.24 s chart on the 2-core host, at the end of every run. a run whose rows carry TRL's reward metrics
    # (GRPO) gets a third panel: the reward and the completions' length
    reward_x, reward_y = series(rows, REWARD_PANEL[0], xkey)
    fig = Figure(figsize=(15 if reward_x else 10, 4))
    fig.subplots_adjust(left=0.07, right=0.95 if reward_x else 0.98, bottom=0.13, top=0.85, wspace=0.28)
    FigureCanvasAgg(fig)
    ax_loss, ax_sps, *ax_reward = fig.subplots(1, 3 if reward_x else 2)
    if ax_reward:
        _reward_panel(ax_reward[0], rows, xkey, reward_x, reward_y)
    if loss_x:
        ax_loss.plot(loss_x, loss_y, lw=1, label="train loss", **dots(loss_x))
    if val_x:
        ax_loss.plot(val_x, val_y, "o-", ms=4, label="val loss")
    ax_loss.set_xlabel(x_label(xkey))
    ax_loss.set_ylabel("loss")
    ax_loss.set_title("loss")
    if loss_x or val_x:
        ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    if sps_x:
        ax_sps.plot(sps_x, sps_y, lw=1, color="tab:green", **dots(sps_x))
    ax_sps.set_xlabel(x_label(xkey))
    ax_sps.set_ylabel("samples/s")
    ax_sps.set_title("throughput")
    ax_sps.grid(alpha=0.3)
    fig.suptitle(run_dir.name)

    out = run_dir / "curves.png"
    save_png(fig, out)
    return out


def _reward_panel(ax, rows: list[dict], xkey: str, reward_x: list, reward_y: list) -> None:
    ax.plot(reward_x, reward_y, lw=1, color="tab:purple", label="reward", **dots(reward_x))
    ax.set_xlabel(x_label(xkey))
    ax.set_ylabel("mean reward")
    ax.set_title("reward and completion length")
    ax.grid(alpha=0.3)
    length_x, length_y = series(rows, REWARD_PANEL[1], xkey)
    if length_x:
        twin = ax.twinx()
        twin.plot(length_x, length_y, lw=1, color="tab:gray", ls="--", **dots(length_x))
        twin.set_ylabel("completion length (tokens, dashed)")


def save_png(fig, path: Path) -> None:
    """The chart whole (a viewer refreshing it never sees half a PNG), never through a link."""
    data = io.BytesIO()
    fig.savefig(data, dpi=100, format="png")
    files.atomic_write(path, data.getvalue())


def comparison_panels(result: dict) -> tuple[str, ...]:
    """compare.png's panels: the memory one only where some side measured VRAM (CPU runs have
    none, and an empty panel with "n/a" says nothing)."""
    has_vram = any(e["peak_vram_mb"] is not None for e in result["runs"])
    return ("throughput", "memory", "loss") if has_vram else ("throughput", "loss")


def throughput_label(result: dict) -> str:
    """The bars' unit: the headline metric, "median" only where a side is several runs."""
    unit = {"tokens_per_sec": "tokens/s"}.get(result.get("metric"), "samples/s")
    repeats = max(e["n"] for e in result["runs"])
    return f"{unit} (median of {repeats} runs)" if repeats > 1 else unit


def plot_comparison(result: dict, curves: dict[str, list[list[dict]]], path: Path) -> Path:
    """compare.png: throughput bars (the headline metric; min-max whiskers for repeats), peak
    VRAM bars where measured, and loss against samples seen for every run (val loss as markers),
    one colour per side.

    result is compare.compare_groups()'s output; curves maps each side's name to the metrics
    rows of its runs. Unlike plot_curves this raises: the user asked for this file.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    entries, metric = result["runs"], result.get("metric", "samples_per_sec")
    names = [e["name"] for e in entries]
    colors = [f"C{i % 10}" for i in range(len(entries))]
    panels = comparison_panels(result)
    fig = Figure(figsize=(5 * len(panels), 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = dict(zip(panels, fig.subplots(1, len(panels)), strict=True))
    ax_sps, ax_loss = axes["throughput"], axes["loss"]

    rate = [e[metric] or 0.0 for e in entries]
    # Whiskers from min to max of the repeats.
    lo = [max(0.0, (e[metric] or 0.0) - (e[f"{metric}_min"] or 0.0)) for e in entries]
    hi = [max(0.0, (e[f"{metric}_max"] or 0.0) - (e[metric] or 0.0)) for e in entries]
    repeats = any(e["n"] > 1 for e in entries)  # a single run has no spread to draw
    bars = ax_sps.bar(names, rate, color=colors, yerr=[lo, hi] if repeats else None, capsize=6)
    labels = [
        "n/a" if e[metric] is None
        else f"{e[metric]:,.1f}" + (f"\n{e['speedup']:.2f}x" if e["speedup"] is not None else "")
        for e in entries
    ]  # fmt: skip
    ax_sps.bar_label(bars, labels=labels, label_type="center")
    ax_sps.set_ylabel(throughput_label(result))
    ax_sps.set_title("throughput")

    if "memory" in axes:
        mem = [e["peak_vram_mb"] or 0.0 for e in entries]
        bars = axes["memory"].bar(names, mem, color=colors)
        labels = [
            "n/a"
            if e["peak_vram_mb"] is None
            else f"{e['peak_vram_mb']:,.0f}"
            + (f"\n{e['vram_pct']:.0f} %" if e["vram_pct"] is not None else "")
            for e in entries
        ]
        axes["memory"].bar_label(bars, labels=labels, label_type="edge")
        axes["memory"].set_ylabel("peak VRAM MB")
        axes["memory"].set_title("memory")

    for n, entry in enumerate(entries):
        color = colors[n]
        for i, rows in enumerate(curves.get(entry["name"], [])):
            xkey = x_key(rows)
            label = entry["name"] if i == 0 else None
            xs, ys = series(rows, "loss", xkey)
            if xs:
                ax_loss.plot(xs, ys, color=color, lw=1, alpha=0.8, label=label, **dots(xs))
                label = None
            xs, ys = series(rows, "val_loss", xkey)
            if xs:
                ax_loss.plot(
                    xs, ys, "o--", color=color, ms=4, lw=1, label=f"{entry['name']} val" if i == 0 else None
                )
    ax_loss.set_xlabel("samples seen")
    ax_loss.set_ylabel("loss")
    ax_loss.set_title("loss")
    ax_loss.grid(alpha=0.3)
    if ax_loss.get_legend_handles_labels()[0]:
        ax_loss.legend()
    note = "" if "memory" in axes else "\n(no memory panel: these runs measured no GPU memory)"
    fig.suptitle(result.get("verdict", "") + note)
    save_png(fig, Path(path))
    return Path(path)
