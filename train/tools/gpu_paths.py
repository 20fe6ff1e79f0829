"""The GPU table's per-path half: each training path's run (GPT-2 pretraining as the preset and
as AUTO_BATCH=1 took it, GPT-2 SFT grouped and packed, T5 pretraining and SFT), its figures from
summary.json, the issue's targets computed from them ("met" or "missed by ..."), and where the
time of one profiled step went (train/tools/step_profile.py's NAME.profile.json).

A field the run did not write (an older checkout, a run that stopped) shows as n/a; a target
whose figures are missing is "not measured"."""

from __future__ import annotations

import json
import re
from pathlib import Path

# (part name in parts.tsv and the run folder, label). pretrain-preset is the doctor's run.
PATHS = (
    ("pretrain-preset", "GPT-2 small pretraining, optimized preset"),
    ("pretrain-auto", "GPT-2 small pretraining, AUTO_BATCH=1"),
    ("sft-grouped", "GPT-2 SFT, LENGTH_GROUPING=1"),
    ("sft-packing1", "GPT-2 SFT, PACKING=1"),
    ("t5-pretrain", "T5 small pretraining (span corruption)"),
    ("t5-sft", "T5 small SFT"),
    ("dpo", "GPT-2 preference training (DPO, REFERENCE=copy)"),
)
GPT2_MFU, T5_MFU, T5_SFT_MFU = 0.45, 0.25, 0.15
PACKED_OF_PRETRAIN = 0.90  # packed SFT tokens/s against pretraining's at the same length
GROUPED_FACTOR = 0.8  # grouped SFT: >= 0.8 x its padding efficiency x pretraining tokens/s
ESTIMATE_WITHIN = 0.10
NOTE = re.compile(r"find-batch measured .*|AUTO_BATCH=1: BATCH_SIZE=.*")


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def collect_paths(out: Path, doctor_json: Path | None) -> dict:
    """{part: {"summary", "profile", "note"}} for every path; a missing file is None."""
    found = {}
    for part, _ in PATHS:
        folder = doctor_json.parent if part == "pretrain-preset" and doctor_json else out / part
        note = None
        try:
            note = next((m.group(0) for m in NOTE.finditer((out / f"{part}.log").read_text())), None)
        except OSError:
            pass
        found[part] = {"summary": _json(folder / "summary.json"), "profile": _json(out / f"{part}.profile.json"),
                       "note": note}
    return found


def _fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _memory(s: dict) -> str:
    peak, est = s.get("peak_vram_mb"), s.get("estimate_peak_mb")
    if peak is None:
        return "n/a"
    if est is None:
        return f"{peak:,.0f} MB (no estimate)"
    return f"{peak:,.0f} MB, estimated {est:,.0f} ({(est - peak) / peak:+.0%})"


def _compile(s: dict) -> str:
    c = s.get("compile")
    if not isinstance(c, dict):
        return "n/a"
    if not c.get("enabled"):
        return "off" + (f" ({s['compile_error']})" if s.get("compile_error") else "")
    graphed = "" if c.get("cuda_graphs") is None else \
        f", {c['cuda_graphs']} CUDA graphs ({_fmt(c.get('cudagraph_skips'), 'd')} left uncaptured)"
    return f"{_fmt(c.get('graphs'), 'd')} graphs, {_fmt(c.get('recompiles'), 'd')} recompiles, " \
           f"{_fmt(c.get('graph_breaks'), 'd')} breaks" + graphed


def _busy(p: dict | None) -> str:
    if p is None or "step_ms" not in p:
        return "not profiled"
    share = _fmt(p.get("device_busy_frac"), ".0%") if p.get("device") != "cpu" else "n/a (CPU)"
    return f"{share} of {p['step_ms']:.0f} ms" + (" (compiled in it)" if p.get("compiled_during_step") else "")


def _settings(s: dict) -> str:
    batch = f"{s.get('batch_size', '?')} x {s.get('gradient_accumulation_steps', '?')}"
    return f"{s.get('precision', '?')}, {batch}, T={s.get('max_length', '?')}"


def path_rows(found: dict, took) -> list[str]:
    lines = ["", "Every path, one run each (GPU busy: the share of one profiled step's wall time with a kernel "
             "or copy running; tokens/s are real tokens, steady state):", "",
             "| path | settings | tokens/s | MFU | peak VRAM vs estimate | host syncs/step | compile | "
             "compute share | GPU busy | took |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for part, label in PATHS:
        s = found[part]["summary"]
        if s is None:
            lines.append(f"| {label} | | | | | | | | | {took(part)} |")
            continue
        cells = [label, _settings(s), _fmt(s.get("tokens_per_sec"), ",.0f"), _fmt(s.get("mfu"), ".1%"),
                 _memory(s), _fmt(s.get("host_syncs_per_step"), ".2f"), _compile(s),
                 _fmt(s.get("compute_frac"), ".0%"), _busy(found[part]["profile"]), took(part)]
        lines.append("| " + " | ".join(cells) + " |")
    notes = [f"- {part}: the run said: \"{found[part]['note']}\"" for part in ("pretrain-preset", "pretrain-auto")
             if found[part]["note"]]
    return lines + ([""] + notes if notes else [])


def _at_least(value, goal, unit: str) -> str:
    """'met' or 'missed by X' for a figure that must reach goal."""
    if value is None or goal is None:
        return "not measured"
    if value >= goal:
        return "met"
    if unit == "%":
        return f"missed by {100 * (goal - value):.1f} points"
    return f"missed by {goal - value:,.0f} {unit} ({1 - value / goal:.0%} short)"


def targets(found: dict) -> list[tuple[str, str, str, str]]:
    """(target, measured, verdict, part) for each of the issue's targets, from the summaries."""
    s = {part: found[part]["summary"] or {} for part, _ in PATHS}
    pre = s["pretrain-preset"].get("tokens_per_sec")
    rows = []
    for part, what in (("pretrain-preset", "preset"), ("pretrain-auto", "AUTO_BATCH=1")):
        mfu = s[part].get("mfu")
        rows.append((f"GPT-2 small pretraining ({what}) MFU >= {GPT2_MFU:.0%}", _fmt(mfu, ".1%"),
                     _at_least(mfu, GPT2_MFU, "%"), part))
    packed = s["sft-packing1"].get("tokens_per_sec")
    goal = PACKED_OF_PRETRAIN * pre if pre else None
    rows.append((f"packed SFT tokens/s >= {PACKED_OF_PRETRAIN:.0%} of pretraining's ({_fmt(pre, ',.0f')})",
                 _fmt(packed, ",.0f"), _at_least(packed, goal, "tokens/s"), "sft-packing1"))
    grouped, eff = s["sft-grouped"].get("tokens_per_sec"), s["sft-grouped"].get("padding_efficiency")
    goal = GROUPED_FACTOR * eff * pre if pre and eff else None
    rows.append((f"grouped SFT tokens/s >= {GROUPED_FACTOR} x padding efficiency ({_fmt(eff, '.1%')}) x "
                 f"pretraining's = {_fmt(goal, ',.0f')}", _fmt(grouped, ",.0f"),
                 _at_least(grouped, goal, "tokens/s"), "sft-grouped"))
    for part, goal in (("t5-pretrain", T5_MFU), ("t5-sft", T5_SFT_MFU)):
        mfu = s[part].get("mfu")
        rows.append((f"{dict(PATHS)[part]} MFU >= {goal:.0%}", _fmt(mfu, ".1%"), _at_least(mfu, goal, "%"), part))
    for part in ("t5-pretrain", "t5-sft"):
        peak, est = s[part].get("peak_vram_mb"), s[part].get("estimate_peak_mb")
        off = abs(est - peak) / peak if peak and est is not None else None
        verdict = "not measured" if off is None else \
            ("met" if off <= ESTIMATE_WITHIN else f"missed by {100 * (off - ESTIMATE_WITHIN):.0f} points")
        measured = "n/a" if off is None else f"estimate {est:,.0f} MB vs peak {peak:,.0f} MB ({(est - peak) / peak:+.0%})"
        rows.append((f"{dict(PATHS)[part]}: memory estimate within {ESTIMATE_WITHIN:.0%} of the peak", measured,
                     verdict, part))
    return rows


def _where(p: dict | None) -> str:
    """What the profiled step shows, in one cell: GPU busy and the largest kernel categories."""
    if p is None or "step_ms" not in p:
        return "not profiled" if p is None else f"not profiled ({p.get('error', '?')})"
    cats = ", ".join(f"{c['name']} {c['share']:.0%}" for c in (p.get("kernel_categories") or [])[:3])
    return f"GPU busy {_fmt(p.get('device_busy_frac'), '.0%')} of the step" + (f"; kernel time: {cats}" if cats else "")


def target_rows(found: dict) -> list[str]:
    lines = ["", "Against the issue's targets (computed from the figures above):", "",
             "| target | measured | result | the profiled step |", "|---|---|---|---|"]
    for target, measured, verdict, part in targets(found):
        shown = "" if verdict in ("met", "not measured") else _where(found[part]["profile"])
        lines.append(f"| {target} | {measured} | {verdict} |" + (f" {shown} |" if shown else " |"))
    return lines


def profile_rows(found: dict) -> list[str]:
    """Where one step's time went, per path (python -m train.tools.step_profile)."""
    lines = ["", "One step of each path under torch.profiler (step 2, inside the warm-up the throughput "
             "leaves out; a device sync at both ends):", "",
             "| path | step ms | GPU busy | kernel time by category | top ops by self device time (CPU time on a CPU) |",
             "|---|---|---|---|---|"]
    for part, label in PATHS:
        p = found[part]["profile"]
        if p is None or "step_ms" not in p:
            continue
        cats = ", ".join(f"{c['name']} {c['share']:.0%}" for c in (p.get("kernel_categories") or [])[:4]) or "n/a"
        key = "device_ms" if p.get("device_busy_frac") is not None else "cpu_ms"
        ops = ", ".join(f"{o['name'][:40]} {o[key]:.1f} ms" for o in p.get("top_ops", [])[:4]) or "n/a"
        lines.append(f"| {label} | {p['step_ms']:.1f} | {_fmt(p.get('device_busy_frac'), '.0%')} | {cats} | {ops} |")
    return lines if len(lines) > 5 else []
