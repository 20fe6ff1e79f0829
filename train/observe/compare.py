"""`python -m train compare RUN_A RUN_B [...]`: a side-by-side table of finished runs.

Reporting code: reads run folders (summary.json, metrics.jsonl), never imports the loop. Every comparison is a
comparison of groups: a single run is a group of one, and with `--group N` each side is N repeated runs,
summarised by the median with its min-max spread. On a shared 2-core CPU, runs of one config vary about +-9 %
(bench/RESULTS.md, reference figures), so a speed-up only counts when the two sides' throughput ranges do not
overlap.

Units, as the run folder writes them: data_wait_frac and mfu are fractions (0-1) and are shown
as percentages; avg_gpu_util is already a percentage (NVML reports 0-100).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

from train.core import files
from train.core.errors import UsageError
from train.core.objective import MODES
from train.observe.curves import as_number, plot_comparison, read_metrics

# Numbers summarised per group (median over the repeats).
NUMERIC = (
    "samples_per_sec", "tokens_per_sec", "step_time_ms", "data_wait_frac", "peak_vram_mb", "vram_total_mb",
    "vram_pct", "avg_gpu_util", "mfu", "effective_batch_size", "batch_size", "gradient_accumulation_steps",
    "world_size", "final_loss", "final_val_loss",
)
# Throughput numbers also get their spread, because they are what the verdict rests on.
SPREAD = ("samples_per_sec", "tokens_per_sec", "step_time_ms")
# Settings that should match across the sides for samples/s to be like for like ("samples": the
# budget make compare holds fixed; a different count means the sides trained on different data).
LIKE_FOR_LIKE = ("model_size", "max_length", "device_name", "samples")
# What each side did, shown as its runs' values ("/" between repeats that differ): the notes say
# when the sides differ, as final losses after different numbers of steps or tokens don't compare.
COUNTS = ("mode", "steps", "tokens")
# Fewer steady-state steps (after the warm-up ones) than this and a throughput is a guess: on a
# shared 2-core CPU one step alone varies by more than the +-9 % of whole runs.
MIN_STEADY_STEPS = 5
UNITS = {"samples_per_sec": "samples/s", "tokens_per_sec": "tokens/s"}


def load_run(path) -> dict:
    """A run folder as {"name", "path", "summary", "metrics"}; UsageError naming the path when
    the folder or its summary.json is missing or unreadable. metrics.jsonl is optional."""
    run_dir = Path(path)
    if run_dir.name == "summary.json" and run_dir.is_file():
        run_dir = run_dir.parent  # tab completion often lands on the file; accept it
    if not run_dir.is_dir():
        raise UsageError(f"run folder not found: {run_dir}")
    summary_path = run_dir / "summary.json"
    if not summary_path.is_file():
        raise UsageError(f"no summary.json in {run_dir} (run unfinished, or not a run folder?)")
    try:
        summary = json.loads(summary_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read {summary_path}: {e}") from None
    if not isinstance(summary, dict):
        raise UsageError(f"{summary_path} is not a JSON object")
    name = summary.get("run_name")
    if not isinstance(name, str) or not name:
        name = run_dir.resolve().name  # resolve: runs/latest is a link; show the real run
    return {
        "name": name,
        "path": str(run_dir),
        "summary": summary,
        "metrics": read_metrics(run_dir / "metrics.jsonl"),
    }


def run_numbers(summary: dict) -> dict:
    """The numeric fields of one summary, with the two derived ones filled in."""
    nums = {key: as_number(summary.get(key)) for key in NUMERIC}
    if nums["effective_batch_size"] is None and nums["batch_size"] is not None:
        nums["effective_batch_size"] = (
            nums["batch_size"] * (nums["gradient_accumulation_steps"] or 1) * (nums["world_size"] or 1)
        )
    peak, total = nums["peak_vram_mb"], nums["vram_total_mb"]
    nums["vram_pct"] = peak / total * 100 if peak is not None and total else None
    return nums


def median_or_none(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def group_name(names: list[str]) -> str:
    """One name for N repeats: their common prefix without a trailing "_r", "-seed", "_"..."""
    if len(names) == 1:
        return names[0]
    prefix = re.sub(r"([_\-.]+(r|rep|repeat|run|seed))?[_\-.]*$", "", _common_prefix(names))
    return prefix or names[0]


def _common_prefix(names: list[str]) -> str:
    first, last = min(names), max(names)
    n = 0
    while n < min(len(first), len(last)) and first[n] == last[n]:
        n += 1
    return first[:n]


def summarise_group(runs: list[dict]) -> dict:
    """Median of each number over the repeats, plus min/max and +-half-range % for throughput."""
    per_run = [run_numbers(r["summary"]) for r in runs]
    entry: dict = {
        "name": group_name([r["name"] for r in runs]),
        "n": len(runs),
        "runs": [r["name"] for r in runs],
        "paths": [r["path"] for r in runs],
    }
    for key in NUMERIC:
        entry[key] = median_or_none([nums[key] for nums in per_run])
    for key in SPREAD:
        values = [nums[key] for nums in per_run if nums[key] is not None]
        lo, hi = (min(values), max(values)) if values else (None, None)
        mid = entry[key]
        entry[f"{key}_min"], entry[f"{key}_max"] = lo, hi
        entry[f"{key}_spread_pct"] = (hi - lo) / 2 / mid * 100 if values and mid else None
    for key in ("precision", "exit_reason", *LIKE_FOR_LIKE, *COUNTS):
        seen = [str(r["summary"][key]) for r in runs if r["summary"].get(key) is not None]
        entry[key] = "/".join(dict.fromkeys(seen)) or None  # "/" marks repeats that differ
    steady = [as_number(r["summary"].get("steady_state_steps")) for r in runs]
    entry["steady_steps"] = min((s for s in steady if s is not None), default=None)  # the weakest repeat
    return entry


def headline(entries: list[dict]) -> str:
    """The throughput the speed-up rests on: tokens/s for SFT, whose rows vary in length (a side
    of single conversations and one of grouped batches count samples very differently), else
    samples/s (pretraining rows are all MAX_LENGTH tokens, so the two agree)."""
    keys = {MODES[e["mode"]].throughput if e["mode"] in MODES else "samples_per_sec" for e in entries}
    return keys.pop() if len(keys) == 1 else "samples_per_sec"  # each mode's figure; mixed modes: samples/s


def compare_groups(groups: list[list[Path]]) -> dict:
    """Compare sides made of repeated runs. The first side is the baseline of every speed-up.

    Returns {"runs": [one entry per side], "fastest", "verdict", "notes"}: JSON-ready.
    """
    if not groups or any(not g for g in groups):
        raise UsageError("compare needs at least one run per side")
    entries = [summarise_group([load_run(p) for p in group]) for group in groups]
    seen: dict[str, int] = {}
    for entry in entries:  # two folders with one run name would make an ambiguous table
        seen[entry["name"]] = seen.get(entry["name"], 0) + 1
        if seen[entry["name"]] > 1:
            entry["name"] = f"{entry['name']} ({seen[entry['name']]})"

    base, metric = entries[0], headline(entries)
    for entry in entries:
        rate, base_rate = entry[metric], base[metric]
        entry["speedup"] = rate / base_rate if rate is not None and base_rate else None
        entry["within_noise"] = _overlap(base, entry, metric) if entry is not base else None

    rated = [e for e in entries if e[metric] is not None]
    fastest = max(rated, key=lambda e: e[metric])["name"] if rated else None
    return {
        "metric": metric,
        "runs": entries,
        "fastest": fastest,
        "verdict": verdict(entries, metric),
        "notes": notes(entries, metric),
    }


def compare_runs(run_dirs: list[Path]) -> dict:
    """Compare single runs: groups of one, so there is one code path."""
    return compare_groups([[Path(p)] for p in run_dirs])


def _overlap(a: dict, b: dict, metric: str = "samples_per_sec") -> bool | None:
    """Do the throughput ranges touch? None when neither side has repeats: one run per side
    says nothing about noise, so singletons never get a noise verdict."""
    if a["n"] < 2 and b["n"] < 2:
        return None
    if a[f"{metric}_min"] is None or b[f"{metric}_min"] is None:
        return None
    return max(a[f"{metric}_min"], b[f"{metric}_min"]) <= min(a[f"{metric}_max"], b[f"{metric}_max"])


def verdict(entries: list[dict], metric: str = "samples_per_sec") -> str:
    """The line under the table: who is fastest and by how much, or that it is noise."""
    base, unit = entries[0], UNITS[metric]
    if len(entries) < 2:
        return "one side only: nothing to compare"
    missing = [e["name"] for e in entries if e[metric] is None]
    if missing:
        return f"no speed-up: {unit} missing for {', '.join(missing)}"
    if not base[metric]:
        return f"no speed-up: {base['name']} has 0 {unit}"
    many = len(entries) > 2
    parts = [
        f"{e['name']} is {e['speedup']:.2f}x {base['name']}"
        + (" (within noise)" if many and e["within_noise"] else "")
        for e in entries[1:]
    ]
    line = "; ".join(parts) + f" ({unit})"
    fastest = max(entries, key=lambda e: e[metric])
    if many:
        return f"{fastest['name']} is fastest: {line}"
    other = entries[1]
    if other["within_noise"]:
        return (f"within noise: {line}, but the {unit} ranges overlap ({_range(base, metric)} vs "
                f"{_range(other, metric)})")
    if metric != "samples_per_sec" and other["samples_per_sec"] and base["samples_per_sec"]:
        line += f"; {other['samples_per_sec'] / base['samples_per_sec']:.2f}x in samples/s"
    return line if fastest is other else f"{base['name']} is fastest: {line}"


def _range(entry: dict, metric: str) -> str:
    return f"{fmt_rate(entry[f'{metric}_min'])}-{fmt_rate(entry[f'{metric}_max'])}"


def notes(entries: list[dict], metric: str = "samples_per_sec") -> list[str]:
    """Warnings a reader needs before trusting the speed-up or comparing the losses."""
    out = []
    for key in LIKE_FOR_LIKE:
        values = [e[key] for e in entries]
        if len(set(values)) > 1 and all(v is not None for v in values):
            out.append(f"runs differ in {key} ({' vs '.join(values)}): {UNITS[metric]} are not like for like")
    for e in entries:
        if e["steady_steps"] is not None and e["steady_steps"] < MIN_STEADY_STEPS:
            out.append(f"{e['name']} has {fmt_int(e['steady_steps'])} steady-state step(s), fewer than "
                       f"{MIN_STEADY_STEPS}: its "
                       f"{UNITS[metric]} and the speed-up are a guess; train longer (COMPARE_SAMPLES, "
                       f"MAX_STEPS)")
    for key, what in (("steps", "optimizer steps"), ("tokens", "tokens")):
        values = [e[key] for e in entries]
        if len(set(values)) > 1 and all(v is not None for v in values):
            shown = " vs ".join(fmt_count(v) for v in values)
            out.append(f"the sides trained different numbers of {what} ({shown}): their final losses are not "
                       f"comparable")
    for e in entries:
        for key in ("precision", *LIKE_FOR_LIKE):
            if e[key] and "/" in e[key] and e["n"] > 1:
                out.append(f"repeats of {e['name']} differ in {key} ({e[key]})")
    return out


# ---- Markdown ---------------------------------------------------------------------------


def fmt_rate(x: float | None) -> str:
    if x is None:
        return "n/a"
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.1f}"


def fmt_num(x: float | None, spec: str, suffix: str = "") -> str:
    return "n/a" if x is None else f"{x:{spec}}{suffix}"


def fmt_count(text: str | None) -> str:
    """A count as the summaries hold it ("7181", or "7181/6536" for repeats that differ), with commas."""
    return "n/a" if text is None else "/".join(f"{int(v):,}" if v.isdigit() else v for v in text.split("/"))


def fmt_pct(frac: float | None) -> str:
    return "n/a" if frac is None else f"{frac * 100:.1f} %"


def fmt_int(x: float | None) -> str:
    return "n/a" if x is None else (f"{int(x):,}" if float(x).is_integer() else f"{x:,.1f}")


def with_spread(entry: dict, key: str) -> str:
    """Median, then for repeats the range and +-half range as a share of the median."""
    text = fmt_rate(entry[key])
    if entry["n"] > 1 and entry[f"{key}_min"] is not None:
        lo, hi, pct = entry[f"{key}_min"], entry[f"{key}_max"], entry[f"{key}_spread_pct"]
        text += f" ({fmt_rate(lo)}-{fmt_rate(hi)}, ±{fmt_num(pct, '.1f', ' %')})"
    return text


def speedup_cell(entry: dict) -> str:
    text = fmt_num(entry["speedup"], ".2f", "x")
    return text + " (within noise)" if entry["within_noise"] else text


def vram_cell(entry: dict) -> str:
    text = fmt_int(None if entry["peak_vram_mb"] is None else round(entry["peak_vram_mb"]))
    return text if entry["vram_pct"] is None else f"{text} ({entry['vram_pct']:.1f} %)"


def batch_cell(entry: dict) -> str:
    eff, batch, accum = (
        entry["effective_batch_size"],
        entry["batch_size"],
        entry["gradient_accumulation_steps"],
    )
    if batch is None or accum is None:
        return fmt_int(eff)
    gpus = entry["world_size"] or 1
    spread = f"{fmt_int(batch)} x {fmt_int(accum)}" + (f" x {fmt_int(gpus)} GPUs" if gpus > 1 else "")
    return f"{fmt_int(eff)} ({spread})"


ROWS = (
    ("samples/s", lambda e: with_spread(e, "samples_per_sec")),
    ("tokens/s", lambda e: with_spread(e, "tokens_per_sec")),
    ("speed-up", speedup_cell),
    ("ms/step", lambda e: with_spread(e, "step_time_ms")),
    ("data-wait %", lambda e: fmt_pct(e["data_wait_frac"])),
    ("peak VRAM MB (% of total)", vram_cell),
    ("GPU util %", lambda e: fmt_num(e["avg_gpu_util"], ".1f", " %")),
    ("MFU %", lambda e: fmt_pct(e["mfu"])),
    ("effective batch (= batch x accum)", batch_cell),
    ("precision", lambda e: e["precision"] or "n/a"),
    ("optimizer steps / tokens", lambda e: f"{fmt_count(e['steps'])} / {fmt_count(e['tokens'])}"),
    ("final loss", lambda e: fmt_num(e["final_loss"], ".4f")),
    ("final val loss", lambda e: fmt_num(e["final_val_loss"], ".4f")),
    ("exit reason", lambda e: e["exit_reason"] or "n/a"),
)


def render_markdown(result: dict) -> str:
    """A side-by-side table, one column per side (the headline throughput first), then the verdict
    and any notes."""
    entries = result["runs"]
    header = [""] + [e["name"] + (f" (x{e['n']})" if e["n"] > 1 else "") for e in entries]
    lines = ["| " + " | ".join(header) + " |", "|---" + "|---:" * len(entries) + "|"]
    rows = (
        ROWS
        if result.get("metric", "samples_per_sec") == "samples_per_sec"
        else (ROWS[1], ROWS[0], *ROWS[2:])
    )
    for label, cell in rows:
        lines.append("| " + " | ".join([label] + [cell(e) for e in entries]) + " |")
    lines += ["", result["verdict"]]
    lines += [f"note: {n}" for n in result.get("notes", [])]
    return "\n".join(lines) + "\n"


# ---- files and CLI -------------------------------------------------------------------------


def write_outputs(result: dict, out_dir: Path) -> list[Path]:
    """compare.md, compare.json and compare.png in out_dir (created)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    md, js, png = out_dir / "compare.md", out_dir / "compare.json", out_dir / "compare.png"
    files.atomic_write(md, render_markdown(result))
    files.atomic_write(js, json.dumps(result, indent=2) + "\n")
    curves = {
        e["name"]: [read_metrics(Path(p) / "metrics.jsonl") for p in e["paths"]] for e in result["runs"]
    }
    plot_comparison(result, curves, png)
    return [md, js, png]


def default_out_dir(result: dict) -> Path:
    """<parent of the first run folder>/compare/<A>_vs_<B>, next to the runs it compares."""
    names = [re.sub(r"[^\w.-]+", "_", e["name"]).strip("_") or "run" for e in result["runs"]]
    return Path(result["runs"][0]["paths"][0]).parent / "compare" / "_vs_".join(names)


def compare_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m train compare",
        description="Compare finished run folders side by side and write the table as compare.md, "
                    "compare.json and "
        "compare.png. The first run (or group) is the baseline of every speed-up; SFT runs are compared in "
        "tokens/s.",
    )
    parser.add_argument("runs", nargs="+", metavar="RUN", help="run folders, e.g. runs/baseline "
                                                               "runs/optimized")
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default: <parent of first run>/compare/<A>_vs_<B>)")
    parser.add_argument("--group", type=int, default=1, metavar="N",
                        help="consecutive runs are N repeats of one side, in order A1..AN B1..BN; "
                        "each side is shown as its median with the min-max spread")
    args = parser.parse_args(argv)
    if args.group < 1:
        raise UsageError(f"--group must be 1 or more, got {args.group}")
    if len(args.runs) % args.group:
        raise UsageError(
            f"--group {args.group} needs a multiple of {args.group} runs "
            f"(A1..A{args.group} B1..B{args.group}), got {len(args.runs)}"
        )
    paths = [Path(p) for p in args.runs]
    groups = [paths[i : i + args.group] for i in range(0, len(paths), args.group)]
    if len(groups) < 2:
        raise UsageError(
            f"compare needs at least two sides to compare, got {len(paths)} run(s) "
            f"with --group {args.group}: {' '.join(args.runs)}"
        )
    result = compare_groups(groups)
    out_dir = args.out or default_out_dir(result)
    print(render_markdown(result))
    for path in write_outputs(result, out_dir):
        print(f"wrote {path}")
    return 0
