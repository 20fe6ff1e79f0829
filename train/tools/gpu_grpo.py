"""The GPU table's GRPO rows: the kit's reward training (part grpo: ./train_grpo.sh on the built-in
arithmetic task) against TRL's GRPOTrainer on the same plan (part grpo-trl: bench/peers.py, whose
bench/grpo_trl_side.py --kit gets the plan's model, prompt token ids, rows, lengths, stop ids, loss and
rewards), per optimizer step.

A GRPO step samples, scores, then trains, so its figures are its own:
- seconds per optimizer step (steady state), and the target: TRL's >= KIT_OVER_PEER x the kit's;
- generation share: the steady steps' share spent making the completions (sampling, rewards, advantages:
  summary.json's generation_frac; TRL's _generate_and_score_completions);
- completion tokens/s: prompts/s x NUM_GENERATIONS x the completions' mean length over the steady steps
  (metrics.jsonl: the part logs every step). summary.json's own tokens_per_sec counts what the steps
  trained on (prompt + completion of every row), so a prompt's tokens are that per prompt / NUM_GENERATIONS
  less the mean completion; sampling tokens/s is the completion count over the generation seconds alone;
- MFU: the training pass's FLOPs (the loss's forward and backward over prompt + completion tokens,
  summary.json's flops_per_token each: 6N + attention) per second of the whole step, and per second of
  the step outside the rollout (the training part). Sampling's FLOPs are not counted: the whole-step
  figure is a floor. The peer's by the kit's count (the same model, prompts and peak);
- peak memory, and one profiled step of each (GPU busy; train/tools/step_profile.py's record).
A figure its run did not write shows as n/a (None in bench/gpu_table.json)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from train.tools.gpu_paths import KIT_OVER_PEER, _busy, _fill, _fmt, _goal, _json, _verdict, _where

PART, PEER, TRAINER = "grpo", "grpo-trl", "TRL GRPOTrainer"
PARTS = (PART, PEER)
LABEL = "GPT-2 reward training (GRPO, built-in task)"
FIGURES = ("step_time_ms", "generation_frac", "tokens_per_sec", "sampling_tokens_per_sec",
           "completion_mean_length", "mfu", "mfu_training", "peak_memory_mb", "memory_share",
           "estimate_mb")  # each part's in bench/gpu_table.json


def collect(out: Path) -> dict:
    """The two parts' files (None where missing): the kit run's summary.json and metrics rows, the
    peer's NAME.json, and each one's profiled step."""
    try:
        metrics = [json.loads(line) for line in (out / PART / "metrics.jsonl").read_text().splitlines()]
    except (OSError, ValueError):
        metrics = []
    return {"summary": _json(out / PART / "summary.json"), "metrics": metrics,
            "profile": _json(out / f"{PART}.profile.json"), "result": _json(out / f"{PEER}.json"),
            "peer_profile": _json(out / f"{PEER}.profile.json")}  # fmt: skip


def _mean_length(s: dict, metrics: list[dict]):
    """The completions' mean length over the steady steps' metrics rows (else the last one logged)."""
    first = s.get("steps", 0) - s.get("steady_state_steps", 0)
    lengths = [r["completions/mean_length"] for r in metrics
               if r.get("step", 0) > first and r.get("completions/mean_length") is not None]  # fmt: skip
    return statistics.mean(lengths) if lengths else s.get("final_completions/mean_length")


def _rates(step_ms, gen, prompts_s, g, length, prompt_len, fpt, peak_tflops) -> dict:
    """Completion and sampling tokens/s, and the training pass's MFU over the step and its training part."""
    known = None not in (prompts_s, g, length)
    completion = prompts_s * g * length if known else None
    mfu = None
    if known and None not in (prompt_len, fpt) and peak_tflops:
        mfu = prompts_s * g * (prompt_len + length) * fpt / (peak_tflops * 1e12)
    return {
        "step_time_ms": step_ms, "generation_frac": gen, "tokens_per_sec": completion,
        "sampling_tokens_per_sec": completion / gen if completion is not None and gen else None,
        "completion_mean_length": length, "mfu": mfu,
        "mfu_training": mfu / (1 - gen) if mfu is not None and gen is not None and gen < 1 else None,
    }  # fmt: skip


def _shared(s: dict, metrics: list[dict]) -> tuple:
    """(prompt tokens per prompt, flops_per_token, peak TFLOP/s) of the kit's run: both sides' counts. Its
    tokens_per_sec is prompt + completion of NUM_GENERATIONS rows a prompt."""
    prompts_s, tokens_s, g = s.get("samples_per_sec"), s.get("tokens_per_sec"), s.get("num_generations")
    length = _mean_length(s, metrics)
    known = prompts_s and g and None not in (tokens_s, length)
    prompt_len = tokens_s / prompts_s / g - length if known else None
    return prompt_len, s.get("flops_per_token"), s.get("peak_tflops")


def _peak(record: dict) -> dict:
    """Peak memory (torch.cuda.max_memory_allocated) and its share of the device."""
    peak, total = record.get("peak_vram_mb"), record.get("vram_total_mb")
    return {"peak_memory_mb": peak, "memory_share": peak / total if peak is not None and total else None}


def kit_figures(found: dict) -> dict:
    s = found["summary"]
    if not s:
        return {}
    length = _mean_length(s, found["metrics"])
    figures = _rates(s.get("step_time_ms"), s.get("generation_frac"), s.get("samples_per_sec"),
                     s.get("num_generations"), length, *_shared(s, found["metrics"]))  # fmt: skip
    return figures | _peak(s) | {"estimate_mb": s.get("estimate_peak_mb")}


def peer_figures(found: dict) -> dict:
    r = found["result"]
    if not r:
        return {}
    g = (r.get("settings") or {}).get("num_generations")
    figures = _rates(r.get("step_time_ms"), r.get("generation_frac"), r.get("samples_per_sec"), g,
                     r.get("completion_mean_length"),
                     *_shared(found["summary"] or {}, found.get("metrics") or []))  # fmt: skip
    return figures | _peak(r) | {"estimate_mb": None}


def _kit_settings(s: dict) -> str:
    g = s.get("num_generations")
    rows = s["batch_size"] * g if s.get("batch_size") and g else "?"
    return (f"{s.get('precision', '?')}, {s.get('batch_size', '?')} prompts x {g} = {rows} rows x "
            f"{s.get('gradient_accumulation_steps', '?')}, completions <= "
            f"{s.get('max_completion_length', '?')}" + _compiled(s))


def _compiled(s: dict) -> str:
    """The run's compile as summary.json has it (COMPILE empty compiles on a GPU; TRL's side is eager)."""
    c = s.get("compile")
    if not isinstance(c, dict):  # a summary from before the entry: nothing to claim
        return ""
    if not c.get("enabled"):
        return ", eager" + (f" (compile failed: {s['compile_error']})" if s.get("compile_error") else "")
    return f", compile {c.get('mode') or 'default'}"


def _peer_settings(r: dict) -> str:
    ran = r.get("settings") or {}
    precision = "bf16" if ran.get("bf16") else "fp16" if ran.get("fp16") else "fp32"
    return (f"{precision}, {ran.get('batch_size', '?')} prompts x {ran.get('num_generations', '?')} = "
            f"{ran.get('rows', '?')} rows, completions <= {ran.get('max_completion_length', '?')}, "
            f"checkpointing {int(bool(ran.get('gradient_checkpointing')))}, vLLM "
            f"{int(bool(ran.get('use_vllm')))}, {ran.get('attn_implementation', '?')}")


def _memory(f: dict) -> str:
    peak, share = f.get("peak_memory_mb"), f.get("memory_share")
    return "n/a" if peak is None else f"{peak:,.0f} MB" + (f" ({share:.0%})" if share is not None else "")


def goals(found: dict) -> list[dict]:
    """The GRPO targets (gpu_paths' goal records): TRL's seconds per step >= KIT_OVER_PEER x the kit's,
    and the kit's default run filling the device (peak memory or GPU busy)."""
    kit, peer = kit_figures(found), peer_figures(found)
    mine, theirs = kit.get("step_time_ms"), peer.get("step_time_ms")
    ratio = theirs / mine if mine and theirs else None
    shown = "n/a" if ratio is None else f"{ratio:.2f}x ({theirs:,.0f} / {mine:,.0f} ms a step)"
    target = f"{LABEL}: {TRAINER} s/step / the kit's >= {KIT_OVER_PEER}x"
    rows = [_goal(PART, target, ratio, KIT_OVER_PEER, "x", shown)
            | {"peer": PEER, "trainer": TRAINER, "measure": "seconds per optimizer step, peer / kit"}]
    if found["summary"]:
        rows.append(_fill(PART, found["summary"], found["profile"], LABEL))
    return rows


def rows(found: dict, took) -> list[str]:
    """The GRPO section of the GPU table (nothing where neither part ran)."""
    if took(PART) == "not run" and took(PEER) == "not run":
        return []
    lines = ["", f"{LABEL} against {TRAINER} on the same plan (bench/peers.py {PEER}: the kit part's "
             "model, prompt token ids, NUM_GENERATIONS, MAX_COMPLETION_LENGTH, stop ids, loss, rewards, "
             "batch and precision). Completion tokens/s: prompts/s x NUM_GENERATIONS x the completions' "
             "mean length; sampling tokens/s: the same over the generation seconds; MFU: the training "
             "pass's FLOPs (prompt + completion tokens) over the whole step, and over the step outside "
             "the rollout:", "",
             "| side | settings | ms/step | generation share | completion tokens/s | sampling tokens/s | "
             "mean completion length | MFU (step) | MFU (training part) | peak memory | GPU busy | took |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for part, name, source, figures, profile, settings in (
        (PART, "the kit", found["summary"], kit_figures(found), found["profile"], _kit_settings),
        (PEER, TRAINER, found["result"], peer_figures(found), found["peer_profile"], _peer_settings),
    ):
        if not source:
            lines.append(f"| {name} ({part}) | | | | | | | | | | | {took(part)} |")
            continue
        f = figures
        cells = [f"{name} ({part})", settings(source), _fmt(f["step_time_ms"], ",.0f"),
                 _fmt(f["generation_frac"], ".0%"), _fmt(f["tokens_per_sec"], ",.0f"),
                 _fmt(f["sampling_tokens_per_sec"], ",.0f"), _fmt(f["completion_mean_length"], ".1f"),
                 _fmt(f["mfu"], ".1%"), _fmt(f["mfu_training"], ".1%"), _memory(f), _busy(profile),
                 took(part)]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| target | measured | result | the profiled step |", "|---|---|---|---|"]
    for g in goals(found):
        shown = "" if g["met"] is None or g["met"] else _where(found["profile"])
        lines.append(f"| {g['target']} | {g['measured']} | {_verdict(g)} | {shown} |")
    return lines


def part_figures(name: str, found: dict) -> dict:
    """One GRPO part's figures for bench/gpu_table.json."""
    if name == PEER:
        r = found["result"] or {}
        head = {"kind": "peer", "trainer": TRAINER, "against": PART, "settings": r.get("settings"),
                "versions": r.get("versions")}  # fmt: skip
        figures, profile = peer_figures(found), found["peer_profile"]
    else:
        head = {"kind": "kit", "settings": _kit_settings(found["summary"]) if found["summary"] else None}
        figures, profile = kit_figures(found), found["profile"]
    blank = dict.fromkeys(FIGURES)
    busy = (profile or {}).get("device_busy_frac")
    return head | blank | figures | {"tokens_counted": "completion tokens", "gpu_busy": busy,
                                     "padding_efficiency": None}
