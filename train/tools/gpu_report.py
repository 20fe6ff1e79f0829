"""`make gpu-report`'s second half: the outputs of one GPU session -> bench/RESULTS.md's GPU table.

scripts/gpu_report.sh runs the kit's own commands (bench, find-batch, doctor, the training
paths, each profiled for one step) into one folder; this reads what they wrote there (bench
--json files, .auto_batch.json, doctor.json, every run's summary.json, NAME.profile.json, the
parts' logs, parts.tsv with each part's seconds and status) and writes the "## GPU table"
section of RESULTS.md, replacing the previous one, naming the device and date, and the same
figures as a machine-readable table (--table, bench/gpu_table.json: every part's tokens/s, MFU,
GPU busy share, peak memory and its share of the device, the estimate, its targets and whether
each was met; the peers' rows named by their trainer; the kit / peer ratios). The per-path rows,
the peers, the issue's targets and the profiles are train/tools/gpu_paths.py's; GRPO's against TRL's
GRPOTrainer, per step, train/tools/gpu_grpo.py's.

    python -m train.tools.gpu_report --out runs/gpu-report-... [--results bench/RESULTS.md] [--table F]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from train.core import files
from train.tools import gpu_grpo, gpu_paths
from train.tools.gpu_paths import _json

HEADING = "## GPU table"
# SFT runs by folder name -> the PACKING cell of their row (plain, grouped, packed)
SFT_RUNS = {"packing0": "0", "grouped": "0, LENGTH_GROUPING=1", "packing1": "1"}


def collect(out: Path) -> dict:
    """Every figure the session left in `out`; a part that wrote nothing is None."""
    parts = {}
    for line in (out / "parts.tsv").read_text().splitlines() if (out / "parts.tsv").is_file() else []:
        name, seconds, status = (line.split("\t") + ["", ""])[:3]
        parts[name] = {"seconds": int(seconds or 0), "status": status}
    doctor = next(iter(sorted(out.glob("*/doctor.json"))), None)
    return {
        "parts": parts,
        "bench_baseline": _json(out / "bench-baseline.json"),
        "bench_optimized": _json(out / "bench-optimized.json"),
        "find_batch": _json(out / ".auto_batch.json"),
        "doctor": _json(doctor) if doctor else None,
        "sft": {p: _json(out / f"sft-{p}" / "summary.json") for p in SFT_RUNS},
        "paths": gpu_paths.collect_paths(out, doctor),
        "peers": gpu_paths.collect_peers(out),
        "grpo": gpu_grpo.collect(out),
        "out": str(out),
    }


def _fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _took(fig: dict, part: str) -> str:
    p = fig["parts"].get(part)
    if p is None:
        return "not run"
    return f"{p['seconds']} s" + ("" if p["status"] == "ok" else f", {p['status']} (see {part}.log)")


def _bench_rows(fig: dict) -> list[str]:
    rows = []
    for key, part, label in (("bench_baseline", "bench-baseline", "baseline preset"),
                             ("bench_optimized", "bench-optimized", "optimized preset")):
        r = fig[key]
        if r is None and key == "bench_optimized" and part not in fig["parts"]:
            continue  # the optimized preset's figures are the pretrain-preset path's (gpu_paths)
        if r is None:
            rows.append(f"| bench, {label} | | | | | | {_took(fig, part)} |")
            continue
        k = r["kit"]
        settings = (f"{r['precision']}, compile {int(bool(r['compile']))}, batch {r['batch_size']} x "
                    f"{r['gradient_accumulation_steps']}, T={r['max_length']}")
        rows.append(f"| bench, {label} | {settings} | {k['ms_per_step']:.1f} | {k['tokens_per_sec']:,.0f} | "
                    f"{k['achieved_tflops']:.1f} | {_fmt(k['mfu'], '.1%')} | {_took(fig, part)} |")
    return rows


def section(fig: dict, device: str, date: str) -> str:
    """The Markdown of the GPU table section (ending in one newline)."""
    base, opt = fig["bench_baseline"], fig["bench_optimized"]
    shown = opt or base or {}
    lines = [
        HEADING,
        "",
        f"Written by `make gpu-report` (scripts/gpu_report.sh) on **{device}**, {date}. GPT-2 "
        f"{shown.get('model_size', '?')}, T={shown.get('max_length', '?')}, the built-in corpus; raw "
        f"outputs were in `{fig['out']}`.",
        "",
        "| part | settings | ms/step | tokens/s | TFLOP/s | MFU | took |",
        "|---|---|---|---|---|---|---|",
        *_bench_rows(fig),
    ]
    preset = fig["paths"]["pretrain-preset"]["summary"] or {}
    if base and (opt or preset.get("tokens_per_sec")):
        ratio = (opt["kit"] if opt else preset)["tokens_per_sec"] / base["kit"]["tokens_per_sec"]
        compile_s = opt.get("startup", {}).get("compile_s") if opt else None
        lines += ["", f"Optimized / baseline: **x{ratio:.2f}** tokens/s"
                  + ("" if opt else " (optimized: the pretrain-preset run below)")
                  + (f" (the compiled first step took about {compile_s:.0f} s more than a steady one)."
                     if compile_s is not None else ".")]
    lines += _tool_rows(fig)
    lines += _sft_rows(fig)
    found = fig["paths"]
    lines += gpu_paths.path_rows(found, lambda part: _took(fig, part))
    lines += gpu_paths.peer_rows(found, fig["peers"], lambda part: _took(fig, part))
    lines += gpu_paths.target_rows(found, fig["peers"])
    lines += gpu_paths.profile_rows(found)
    lines += gpu_grpo.rows(fig["grpo"], lambda part: _took(fig, part))
    return "\n".join(lines) + "\n"


def _tool_rows(fig: dict) -> list[str]:
    lines = ["", "| tool | result | took |", "|---|---|---|"]
    fb, doc = fig["find_batch"], fig["doctor"]
    # the doctor's run is the pretrain-preset path's (profiled) where the script ran it that way
    doctor = (
        "doctor" if "doctor" in fig["parts"] or "pretrain-preset" not in fig["parts"] else "pretrain-preset"
    )
    # find-batch's search runs inside pretrain-auto (AUTO_BATCH=1) where it is no part of its own
    search = (
        "find-batch"
        if "find-batch" in fig["parts"] or "pretrain-auto" not in fig["parts"]
        else "pretrain-auto"
    )
    if fb:
        label = f"find-batch ({fb.get('key', {}).get('precision', '?')})"
        rate = "" if fb.get("samples_per_sec") is None else f", {fb['samples_per_sec']:.1f} samples/s"
        lines.append(f"| {label} | BATCH_SIZE={fb['batch_size']} GRADIENT_ACCUM="
                     f"{fb['gradient_accumulation_steps']} (largest safe {fb['largest_safe']}{rate}, peak "
                     f"{_fmt(fb.get('peak_mb'), ',.0f')} of {fb['limit_mb']:,.0f} MB) | "
                     f"{_took(fig, search)}{' (in that run)' if search != 'find-batch' else ''} |")
    else:
        lines.append(f"| find-batch | no result | {_took(fig, search)} |")
    if doc:
        v = doc["verdict"]
        lines.append(f"| doctor ({doc['before']['precision']}) | {v['kind']}: {v['why']}; "
                     f"try: {doc.get('try') or 'nothing'} | {_took(fig, doctor)} |")
    else:
        lines.append(f"| doctor | no result | {_took(fig, doctor)} |")
    return lines


def _sft_rows(fig: dict) -> list[str]:
    sft = fig["sft"]
    lines = ["", "SFT on the built-in conversations from the doctor run's model, one conversation per row "
             "(PACKING=0, plain or LENGTH_GROUPING=1) vs packed rows (PACKING=1):", "",
             "| PACKING | batch | precision | padding efficiency | samples/s | real tokens/s | step ms | "
             "final loss | took |",
             "|---|---|---|---|---|---|---|---|---|"]
    for p, shown in SFT_RUNS.items():
        s = sft.get(p)
        if s is None:
            if f"sft-{p}" in fig["parts"] or p == "packing1":
                lines.append(f"| {shown} | | | | | | | | {_took(fig, f'sft-{p}')} |")
            continue
        cells = [shown, s.get("batch_size"), s.get("precision"), _fmt(s.get("padding_efficiency"), ".1%"),
                 _fmt(s.get("samples_per_sec"), ".2f"), _fmt(s.get("tokens_per_sec"), ",.0f"),
                 _fmt(s.get("step_time_ms"), ".0f"), _fmt(s.get("final_loss"), ".4f"), _took(fig, f"sft-{p}")]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    if any(s is not None and "packing" not in s for s in sft.values()):
        lines += ["", "PACKING is not a setting of this checkout yet (no `packing` in summary.json): both "
                  "SFT runs used one conversation per row."]
    return lines


def table(fig: dict, device: str, date: str) -> dict:
    """bench/gpu_table.json: every part the session ran (parts.tsv's order), its figures and targets
    (met: true / false, null where not measured; a part's met: every target of it met), and the
    kit / peer ratios."""
    found, peers = fig["paths"], fig["peers"]
    goals = gpu_paths.goals(found, peers) + gpu_grpo.goals(fig["grpo"])
    paths = {part for part, _ in gpu_paths.PATHS}
    parts = []
    for name, p in fig["parts"].items():
        row = {"name": name, "status": p["status"], "seconds": p["seconds"]}
        if name in paths or name in peers:
            row |= gpu_paths.part_figures(name, found, peers)
        elif name in gpu_grpo.PARTS:
            row |= gpu_grpo.part_figures(name, fig["grpo"])
        elif name == "bench-baseline" and fig["bench_baseline"]:
            k = fig["bench_baseline"]["kit"]
            row |= {"kind": "kit", "tokens_per_sec": k["tokens_per_sec"], "mfu": k["mfu"]}
        mine = [g for g in goals if g["part"] == name and "peer" not in g]
        verdicts = [g["met"] for g in mine if g["met"] is not None]
        row |= {"targets": [_plain(g) for g in mine], "met": all(verdicts) if verdicts else None}
        parts.append(row)
    ratios = [{"name": f"{g['part']} / {g['peer']}", "kit": g["part"], "peer": g["peer"],
               "trainer": g["trainer"], "ratio": g["value"],
               "target": g["goal"], "met": g["met"], **{k: g[k] for k in ("measure",) if k in g}}
              for g in goals if "peer" in g]
    return {"device": device, "date": date, "written_by": "make gpu-report (scripts/gpu_report.sh)",
            "out": fig["out"], "parts": parts, "ratios": ratios}


def _plain(goal: dict) -> dict:
    return {k: goal[k] for k in ("target", "value", "goal", "unit", "met", "measured")}


def replace_section(text: str, new: str) -> str:
    """text with its "## GPU table" section (up to the next "## " heading) replaced by new,
    or new appended where there is none; every other line is kept as it was."""
    lines = text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.rstrip() == HEADING), None)
    if start is None:
        return text.rstrip("\n") + "\n\n" + new
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    tail = "".join(lines[end:])
    return "".join(lines[:start]) + new + ("\n" + tail if tail else "")


def device_label() -> str:
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device"
    return f"{torch.cuda.get_device_name(0)} (torch {torch.__version__})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m train.tools.gpu_report", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", required=True, help="the folder scripts/gpu_report.sh wrote")
    parser.add_argument("--results", default="bench/RESULTS.md")
    parser.add_argument("--table", default=None, help="the JSON table (default: gpu_table.json beside "
                                                      "--results)")
    parser.add_argument("--device", default=None, help="device name for the heading (default: torch's)")
    parser.add_argument("--date", default=None, help="date for the heading (default: today)")
    args = parser.parse_args(argv)
    out, results = Path(args.out), Path(args.results)
    if not out.is_dir():
        print(f"error: --out {out}: no such folder", file=sys.stderr)
        return 2
    text = results.read_text() if results.is_file() else "# Benchmark results\n"
    fig = collect(out)
    device, date = args.device or device_label(), args.date or time.strftime("%Y-%m-%d")
    new = section(fig, device, date)
    files.atomic_write(results, replace_section(text, new))
    json_table = Path(args.table) if args.table else results.with_name("gpu_table.json")
    files.write_json(json_table, table(fig, device, date))
    print(new, end="")
    print(f"gpu-report: wrote the GPU table of {results} and {json_table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
