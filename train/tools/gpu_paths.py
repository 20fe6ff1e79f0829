"""The GPU table's per-path half: each training path's run (GPT-2 pretraining as the preset and
as AUTO_BATCH=1 took it, GPT-2 SFT grouped and packed, T5 pretraining and SFT, DPO), its figures
from summary.json, the peers measured on the same plans (bench/peers.py's NAME.json: TRL's
trainers, transformers' Seq2SeqTrainer), the issue's targets computed from them (goals: value,
goal, met; as Markdown "met" or "missed by ..."), and where the time of one profiled step went
(train/tools/step_profile.py's NAME.profile.json; the peers' the same record).

A field the run did not write (an older checkout, a run that stopped) shows as n/a; a target
whose figures are missing is "not measured" (met: null in bench/gpu_table.json)."""

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
# (peer part, the kit part on whose plan it ran, what both train, the peer's trainer)
PEERS = (
    ("trl-sft-padfree", "sft-grouped", "GPT-2 SFT, one conversation per example", "TRL SFTTrainer"),
    ("trl-sft-packed", "sft-packing1", "GPT-2 SFT, packed rows", "TRL SFTTrainer"),
    ("seq2seq-t5-sft", "t5-sft", "T5 small SFT", "transformers Seq2SeqTrainer"),
    ("trl-dpo", "dpo", "GPT-2 DPO", "TRL DPOTrainer"),
)
GPT2_MFU, T5_MFU, T5_SFT_MFU = 0.45, 0.25, 0.15
PACKED_OF_PRETRAIN = 0.90  # packed SFT tokens/s against pretraining's at the same length
GROUPED_FACTOR = 0.8  # grouped SFT: >= 0.8 x its padding efficiency x pretraining tokens/s
DPO_OF_PACKED = 0.8  # DPO real tokens/s against packed SFT's
ESTIMATE_WITHIN = 0.10
FILL_MEMORY, FILL_BUSY = 0.60, 0.90  # a default run fills the device's memory or keeps it busy
KIT_OVER_PEER = 1.3  # the kit's real tokens/s against the peer's on the same plan
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
        found[part] = {
            "summary": _json(folder / "summary.json"),
            "profile": _json(out / f"{part}.profile.json"),
            "note": note,
        }
    return found


def collect_peers(out: Path) -> dict:
    """{peer: {"result", "profile"}}: bench/peers.py's NAME.json and NAME.profile.json, None if missing."""
    return {peer: {"result": _json(out / f"{peer}.json"), "profile": _json(out / f"{peer}.profile.json")}
            for peer, *_ in PEERS}


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
    return f"{share} of {p['step_ms']:.0f} ms" + (
        " (compiled in it)" if p.get("compiled_during_step") else ""
    )


def _settings(s: dict) -> str:
    batch = f"{s.get('batch_size', '?')} x {s.get('gradient_accumulation_steps', '?')}"
    return f"{s.get('precision', '?')}, {batch}, T={s.get('max_length', '?')}"


def path_rows(found: dict, took) -> list[str]:
    lines = ["", "Every path, one run each (GPU busy: the share of one profiled step's wall time with a "
             "kernel or copy running; tokens/s are real tokens, steady state):", "",
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
    notes = [
        f'- {part}: the run said: "{found[part]["note"]}"'
        for part in ("pretrain-preset", "pretrain-auto")
        if found[part]["note"]
    ]
    return lines + ([""] + notes if notes else [])


def peer_mfu(kit: dict, result: dict):
    """The peer's MFU by the kit's FLOPs per token: the same model and lengths, so the kit run's MFU
    scaled by the two real-token rates."""
    mfu, mine, theirs = kit.get("mfu"), kit.get("tokens_per_sec"), result.get("tokens_per_sec")
    return mfu * theirs / mine if mfu is not None and mine and theirs is not None else None


def _peer_settings(r: dict) -> str:
    ran = r.get("settings", {})
    precision = "bf16" if ran.get("bf16") else "fp16" if ran.get("fp16") else "fp32"
    shape = (
        f"packing {ran['packing']}, "
        if ran.get("packing")
        else "padding-free, "
        if ran.get("padding_free")
        else ""
    )
    return (f"{precision}, {shape}batch {ran.get('batch_size', '?')}, T={ran.get('max_length', '?')}, "
            f"checkpointing {int(bool(ran.get('gradient_checkpointing')))}, compile "
            f"{int(bool(ran.get('torch_compile')))}, "
            f"{ran.get('attn_implementation', '?')}")


def peer_rows(found: dict, peers: dict, took) -> list[str]:
    """The peers on the kit's plans, beside the kit's row they ran against."""
    if not any(took(peer) != "not run" for peer, *_ in PEERS):
        return []
    lines = ["", "Peers on the same GPU in the same call (bench/peers.py: the kit part's model, token ids, "
                 "MAX_LENGTH, "
             "batch and precision; the peer's own defaults otherwise; MFU by the kit's FLOPs per token):", "",
             "| peer | on the plan of | settings | real tokens/s | MFU | peak VRAM | GPU busy | the kit's "
             "tokens/s | kit / peer | took |", "|---|---|---|---|---|---|---|---|---|---|"]
    for peer, kit, what, trainer in PEERS:
        r, s = peers[peer]["result"], found[kit]["summary"] or {}
        if r is None:
            if took(peer) != "not run":
                lines.append(f"| {trainer} ({peer}): {what} | {kit} | | | | | | | | {took(peer)} |")
            continue
        mine, theirs = s.get("tokens_per_sec"), r.get("tokens_per_sec")
        peak, total = r.get("peak_vram_mb"), r.get("vram_total_mb")
        memory = "n/a" if peak is None else f"{peak:,.0f} MB" + (f" ({peak / total:.0%})" if total else "")
        cells = [f"{trainer} ({peer}): {what}", kit, _peer_settings(r), _fmt(theirs, ",.0f"),
                 _fmt(peer_mfu(s, r), ".1%"), memory, _busy(peers[peer]["profile"]), _fmt(mine, ",.0f"),
                 "n/a" if not (mine and theirs) else f"{mine / theirs:.2f}x", took(peer)]
        lines.append("| " + " | ".join(cells) + " |")
    versions = next((r["result"].get("versions") for r in peers.values() if r["result"]), None)
    if versions:
        lines += ["", "Peer versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()) + "."]
    return lines


def part_figures(part: str, found: dict, peers: dict) -> dict:
    """One path's or peer's figures for bench/gpu_table.json (None where not measured)."""
    if part in peers:
        kit, trainer = next((k, t) for p, k, _, t in PEERS if p == part)
        r, profile = peers[part]["result"] or {}, peers[part]["profile"]
        kind, extra = "peer", {"trainer": trainer, "against": kit, "settings": r.get("settings"),
                                "versions": r.get("versions")}
        s = {**r, "mfu": peer_mfu(found[kit]["summary"] or {}, r) if r else None}
    else:
        s, profile = found[part]["summary"] or {}, found[part]["profile"]
        kind, extra = "kit", {"settings": _settings(s) if s else None}
    peak, total = s.get("peak_vram_mb"), s.get("vram_total_mb")
    return {"kind": kind, **extra, "tokens_per_sec": s.get("tokens_per_sec"), "mfu": s.get("mfu"),
            "gpu_busy": (profile or {}).get("device_busy_frac"), "peak_memory_mb": peak,
            "memory_share": peak / total if peak is not None and total else None,
            "estimate_mb": s.get("estimate_peak_mb"), "padding_efficiency": s.get("padding_efficiency")}


def _verdict(g: dict) -> str:
    """'met', 'not measured' or 'missed by X' for one goal."""
    value, goal, unit = g["value"], g["goal"], g["unit"]
    if g["met"] is None:
        return "not measured"
    if g["met"]:
        return "met"
    if unit == "%":
        return f"missed by {100 * abs(value - goal):.0f} points" if g.get("at_most") else \
            f"missed by {100 * (goal - value):.1f} points"
    if unit == "x":
        return f"missed by {goal - value:.2f}x"
    if unit == "share":
        return "missed"
    return f"missed by {goal - value:,.0f} {unit} ({1 - value / goal:.0%} short)"


def _goal(part: str, target: str, value, goal, unit: str, shown: str, at_most: bool = False) -> dict:
    met = None if value is None or goal is None else (value <= goal if at_most else value >= goal)
    return {"part": part, "target": target, "value": value, "goal": goal, "unit": unit, "met": met,
            "measured": shown, **({"at_most": True} if at_most else {})}


def _fill(part: str, s: dict, profile: dict | None, label: str | None = None) -> dict:
    """A default run fills the device: peak memory >= FILL_MEMORY of it, or the GPU busy >= FILL_BUSY
    (label: the part's, where it is no row of PATHS)."""
    peak, total = s.get("peak_vram_mb"), s.get("vram_total_mb")
    share = peak / total if peak is not None and total else None
    busy = (profile or {}).get("device_busy_frac")
    met = None if share is None and busy is None else (share or 0) >= FILL_MEMORY or (busy or 0) >= FILL_BUSY
    return {"part": part, "target": f"{label or dict(PATHS)[part]}: peak memory >= {FILL_MEMORY:.0%} of the "
            f"device or GPU busy >= {FILL_BUSY:.0%}", "value": {"memory_share": share, "gpu_busy": busy},
            "goal": {"memory_share": FILL_MEMORY, "gpu_busy": FILL_BUSY}, "unit": "share", "met": met,
            "measured": f"memory {_fmt(share, '.0%')}, GPU busy {_fmt(busy, '.0%')}"}


def goals(found: dict, peers: dict | None = None) -> list[dict]:
    """Each of the issue's targets from the summaries and the peers' figures: {"part", "target",
    "value", "goal", "unit", "met" (None: not measured), "measured" (the figure as shown)}."""
    s = {part: found[part]["summary"] or {} for part, _ in PATHS}
    pre = s["pretrain-preset"].get("tokens_per_sec")
    rows = []
    for part, what in (("pretrain-preset", "preset"), ("pretrain-auto", "AUTO_BATCH=1")):
        mfu = s[part].get("mfu")
        rows.append(_goal(part, f"GPT-2 small pretraining ({what}) MFU >= {GPT2_MFU:.0%}", mfu, GPT2_MFU, "%",
                          _fmt(mfu, ".1%")))
    packed = s["sft-packing1"].get("tokens_per_sec")
    rows.append(_goal("sft-packing1", f"packed SFT tokens/s >= {PACKED_OF_PRETRAIN:.0%} of pretraining's "
                      f"({_fmt(pre, ',.0f')})", packed, PACKED_OF_PRETRAIN * pre if pre else None, "tokens/s",
                      _fmt(packed, ",.0f")))
    grouped, eff = s["sft-grouped"].get("tokens_per_sec"), s["sft-grouped"].get("padding_efficiency")
    goal = GROUPED_FACTOR * eff * pre if pre and eff else None
    rows.append(
        _goal(
            "sft-grouped",
            f"grouped SFT tokens/s >= {GROUPED_FACTOR} x padding efficiency "
            f"({_fmt(eff, '.1%')}) x pretraining's = {_fmt(goal, ',.0f')}",
            grouped,
            goal,
            "tokens/s",
            _fmt(grouped, ",.0f"),
        )
    )
    dpo = s["dpo"].get("tokens_per_sec")
    rows.append(
        _goal(
            "dpo",
            f"DPO real tokens/s >= {DPO_OF_PACKED} x packed SFT's ({_fmt(packed, ',.0f')})",
            dpo,
            DPO_OF_PACKED * packed if packed else None,
            "tokens/s",
            _fmt(dpo, ",.0f"),
        )
    )
    for part, goal in (("t5-pretrain", T5_MFU), ("t5-sft", T5_SFT_MFU)):
        mfu = s[part].get("mfu")
        rows.append(_goal(part, f"{dict(PATHS)[part]} MFU >= {goal:.0%}", mfu, goal, "%", _fmt(mfu, ".1%")))
    for part in ("t5-pretrain", "t5-sft"):
        peak, est = s[part].get("peak_vram_mb"), s[part].get("estimate_peak_mb")
        off = abs(est - peak) / peak if peak and est is not None else None
        shown = "n/a" if off is None else (f"estimate {est:,.0f} MB vs peak {peak:,.0f} MB "
                                           f"({(est - peak) / peak:+.0%})")
        rows.append(_goal(part, f"{dict(PATHS)[part]}: memory estimate within {ESTIMATE_WITHIN:.0%} of the "
                                f"peak", off,
                          ESTIMATE_WITHIN, "%", shown, at_most=True))
    rows += [_fill(part, s[part], found[part]["profile"]) for part, _ in PATHS if found[part]["summary"]]
    for peer, kit, what, trainer in PEERS:
        result = (peers or {}).get(peer, {}).get("result") or {}
        mine, theirs = s[kit].get("tokens_per_sec"), result.get("tokens_per_sec")
        ratio = mine / theirs if mine and theirs else None
        rows.append(_goal(kit, f"{what}: the kit / {trainer} real tokens/s >= {KIT_OVER_PEER}x",
                          ratio, KIT_OVER_PEER, "x", "n/a" if ratio is None else
                          f"{ratio:.2f}x ({mine:,.0f} / {theirs:,.0f})") | {"peer": peer, "trainer": trainer})
    return rows


def targets(found: dict, peers: dict | None = None) -> list[tuple[str, str, str, str]]:
    """(target, measured, verdict, part) for each of the issue's targets (goals, as Markdown cells)."""
    return [(g["target"], g["measured"], _verdict(g), g["part"]) for g in goals(found, peers)]


def _where(p: dict | None) -> str:
    """What the profiled step shows, in one cell: GPU busy and the largest kernel categories."""
    if p is None or "step_ms" not in p:
        return "not profiled" if p is None else f"not profiled ({p.get('error', '?')})"
    cats = ", ".join(f"{c['name']} {c['share']:.0%}" for c in (p.get("kernel_categories") or [])[:3])
    return f"GPU busy {_fmt(p.get('device_busy_frac'), '.0%')} of the step" + (
        f"; kernel time: {cats}" if cats else ""
    )


def target_rows(found: dict, peers: dict | None = None) -> list[str]:
    lines = ["", "Against the issue's targets (computed from the figures above):", "",
             "| target | measured | result | the profiled step |", "|---|---|---|---|"]
    for target, measured, verdict, part in targets(found, peers):
        shown = "" if verdict in ("met", "not measured") else _where(found[part]["profile"])
        lines.append(f"| {target} | {measured} | {verdict} |" + (f" {shown} |" if shown else " |"))
    return lines


def profile_rows(found: dict) -> list[str]:
    """Where one step's time went, per path (python -m train.tools.step_profile)."""
    lines = ["", "One step of each path under torch.profiler (step 2, inside the warm-up the throughput "
             "leaves out; a device sync at both ends):", "",
             "| path | step ms | GPU busy | kernel time by category | top ops by self device time (CPU time "
             "on a CPU) |",
             "|---|---|---|---|---|"]
    for part, label in PATHS:
        p = found[part]["profile"]
        if p is None or "step_ms" not in p:
            continue
        cats = (
            ", ".join(f"{c['name']} {c['share']:.0%}" for c in (p.get("kernel_categories") or [])[:4])
            or "n/a"
        )
        key = "device_ms" if p.get("device_busy_frac") is not None else "cpu_ms"
        ops = ", ".join(f"{o['name'][:40]} {o[key]:.1f} ms" for o in p.get("top_ops", [])[:4]) or "n/a"
        lines.append(f"| {label} | {p['step_ms']:.1f} | {_fmt(p.get('device_busy_frac'), '.0%')} | {cats} | "
                     f"{ops} |")
    return lines if len(lines) > 5 else []
