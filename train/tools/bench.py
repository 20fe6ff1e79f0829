"""`python -m train bench`: throughput of the real training loop, optionally against a plain loop.

The kit side is train.run.loop.trainer.run_loop itself (the code the launchers run: same optimizer, step,
DataLoader over the token cache, tqdm, logging), not a copy, so every overhead a user pays is in the figure
(nanoGPT's bench.py idea: no second, faster copy of the loop). `--vs-plain` times the simplest correct loop,
pre-made tensors already in memory, `model(x, labels=x).loss.backward(); opt.step(); opt.zero_grad()` with
torch's default AdamW, on a copy of the same initial model and the same batches, in the same process. Rounds
alternate kit/plain (ABBA order) because a shared machine's load drifts; figures are medians over rounds and
the ratio is the median of the per-round kit/plain ratios. Nothing is written to runs/: each kit round logs
into a temporary folder that is deleted.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from train.core import files
from train.core.errors import UsageError

if TYPE_CHECKING:
    from train.run.plan.make import Plan

DEFAULT_ROUNDS = 5
DEFAULT_STEPS = {"cpu": 10, "other": 50}  # optimizer steps per round when MAX_STEPS is unset


def bench_parser() -> argparse.ArgumentParser:
    from train.config.flags import ArgParser

    parser = ArgParser(
        prog="python -m train bench",
        add_help=False,
        description="Time the real training loop (warm-up excluded); every training flag applies. "
        "MAX_STEPS is the steps per round (default 10 on CPU, 50 on a GPU).",
    )
    parser.add_argument(
        "--vs-plain", action="store_true", help="also time a plain PyTorch loop on the same model and batches"
    )
    parser.add_argument(
        "--rounds", default=str(DEFAULT_ROUNDS), help="kit (and plain) rounds, alternated; medians reported"
    )
    parser.add_argument("--threads", default=None, help="torch.set_num_threads (CPU); empty: torch's default")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    return parser


def _whole(name: str, text: str | None, minimum: int) -> int | None:
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise UsageError(f"{name.upper()} (--{name}): expected a whole number >= {minimum}, got {text!r}")
    return value


def process_age_s() -> float | None:
    """Seconds since this process started (Linux /proc), so start-up (imports, tokenizer,
    token cache, model) counts toward time-to-first-step; None where /proc is missing."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")
        return float(Path("/proc/uptime").read_text().split()[0]) - started
    except (OSError, ValueError, IndexError):
        return None


def cpu_model() -> str | None:
    """The CPU's model name (platform.processor() is empty on Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def result_device_name(device) -> str:
    from train.core.device import device_name

    return (cpu_model() if device.type == "cpu" else None) or device_name(device)


def plain_round(model, batches: list, accum: int, lr: float, device, precision: str, skip: int) -> dict:
    """The reference: the simplest correct loop over tensors already on the device."""
    import torch

    from train.core.device import synchronize

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    opt = torch.optim.AdamW(model.parameters(), lr=lr)  # torch's default implementation
    steps = len(batches) // accum
    first_loss = None
    cpu0, start = time.process_time(), time.perf_counter()
    for step in range(steps):
        if step == skip:
            synchronize(device)
            start = time.perf_counter()
        for micro in range(accum):
            x = batches[step * accum + micro]
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                loss = model(x, labels=x).loss
            scaler.scale(loss / accum if accum > 1 else loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if step == 0:
            first_loss = loss.item()  # a sync in the warm-up step, which is not timed
    synchronize(device)
    elapsed, cpu_s = time.perf_counter() - start, time.process_time() - cpu0
    return {
        "total_steps": steps,
        "steady_steps": steps - skip,
        "steady_s": elapsed,
        "cpu_s": cpu_s,
        "first_loss": first_loss,
        "final_loss": loss.item(),
    }


def kit_round(plan: Plan, say) -> dict:
    """One run of train.run.loop.trainer.run_loop (what `python -m train pretrain` runs) into a temporary
    run folder; its own steady-state figures (warm-up excluded) are the kit's."""
    from train.run.guard.resume import RunGuard
    from train.run.loop.trainer import run_loop
    from train.run.rundir.folder import RunDir

    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        run_dir = RunDir(Path(tmp) / "round", overwrite=False)
        cpu0, call0 = time.process_time(), time.perf_counter()
        try:
            # a fresh run: no checkpoint to find, so no optimizer groups to check one against
            summary = run_loop(plan, run_dir, say, RunGuard(plan, run_dir.path, say, param_groups=list))
        finally:
            run_dir.close()
        call_s = time.perf_counter() - call0
        rows = (run_dir.path / "metrics.jsonl").read_text().splitlines()
        first = json.loads(rows[0]) if rows else {}
    if summary["exit_reason"] != "completed":
        raise KeyboardInterrupt
    return {
        "total_steps": summary["steps"],
        "steady_steps": summary["steady_state_steps"],
        "steady_s": summary["steady_state_steps"] * summary["step_time_ms"] / 1000,
        "cpu_s": time.process_time() - cpu0,
        "first_step_s": summary["time_to_first_step_s"],
        # optimizer, loader and summary work around the timed loop (an upper bound on set-up)
        "setup_s": max(0.0, call_s - summary["wall_time_s"]),
        "first_loss": first.get("loss") if first.get("step") == 1 else None,  # logged only with LOG_EVERY=1
        "final_loss": summary["final_loss"],
    }


def figures(rounds: list[dict], effective: int, max_length: int, fpt: float, peak: float | None) -> dict:
    """Medians over rounds of ms/step, samples/s, tokens/s, TFLOP/s and MFU."""
    from train.core.measure.mfu import achieved_tflops, mfu

    per_round = [sps(r, effective) for r in rounds]
    median = statistics.median(per_round)
    return {
        "samples_per_sec_rounds": per_round,
        "samples_per_sec": median,
        "ms_per_step": 1000 * effective / median,
        "tokens_per_sec": median * max_length,
        "achieved_tflops": achieved_tflops(median * max_length, fpt),
        "mfu": mfu(median * max_length, fpt, peak),
        "cpu_ms_per_step": statistics.median(1000 * r["cpu_s"] / r["total_steps"] for r in rounds),
    }


def sps(r: dict, effective: int) -> float:
    """Steady-state samples/s of one round."""
    return effective * r["steady_steps"] / r["steady_s"]


def run_bench(cfg, rounds: int, vs_plain: bool, threads: int | None, say=print) -> dict:
    """Build as `pretrain` does, then alternate kit and plain rounds; returns every figure."""
    import torch

    from train.core.device import device_name, resolve_device
    from train.core.measure.mfu import peak_flops
    from train.core.model import count_params
    from train.data.stream import BatchStream
    from train.models.flops import model_flops_per_token
    from train.run.loop.meter import steady_start
    from train.run.loop.parts import data_loader
    from train.run.plan.build import build
    from train.tools.dryrun import run_lengths

    if threads is not None:
        torch.set_num_threads(threads)
    o = cfg.optim
    if o.max_steps is None and o.epochs is None and o.max_samples is None:
        o.max_steps = DEFAULT_STEPS["cpu" if resolve_device(cfg.system.device)[0].type == "cpu" else "other"]
    build0 = time.perf_counter()
    plan = build(cfg, say)
    cfg, o = plan.cfg, plan.cfg.optim  # as decided
    startup = {"build_s": time.perf_counter() - build0}
    device, steps, accum = plan.device, plan.total_steps, o.gradient_accumulation_steps
    if steps < 2:
        raise UsageError("MAX_STEPS (--max_steps): bench needs at least 2 steps per round (one is warm-up)")
    skip = steady_start(steps)  # the warm-up run_loop itself leaves out of its figures
    effective = cfg.effective_batch_size()
    n_params = count_params(plan.model)
    fpt = model_flops_per_token(plan.model, *run_lengths(plan))
    plan.family.layout.causal_only(vs_plain, "bench --vs-plain: the plain reference loop is a causal LM's "
                                   "(model(x, labels=x)); bench an encoder-decoder (MODEL_FAMILY=t5) without "
                                   "--vs-plain")
    peak = peak_flops(
        device_name(device) if device.type == "cuda" else None, plan.precision, tf32=cfg.system.tf32
    )
    plain_model = copy.deepcopy(plan.model) if vs_plain else None  # same initial weights as the kit's
    say(
        f"bench: {plan.model_size} ({n_params / 1e6:.1f}M params), {plan.precision}, batch {o.batch_size} x "
        f"accum {accum}, "
        f"max_length {plan.max_length}, workers {cfg.data.num_workers}, compile {int(cfg.model.compile)}, "
        f"{torch.get_num_threads()} thread(s), {device} ({result_device_name(device)}); "
        f"{rounds} round(s) of {steps} steps, {skip} warm-up step(s) excluded per round"
    )
    kit_rounds, plain_rounds, batches = [], [], []
    for i in range(rounds):
        # ABBA order (kit first in odd rounds, plain first in even ones): a load that drifts
        # during a pair favours neither side.
        plain = None
        if vs_plain and i % 2 == 1:
            plain = plain_round(plain_model, batches, accum, o.learning_rate, device, plan.precision, skip)
        age, cpu = process_age_s(), time.process_time()
        lines: list[str] = []
        kit = kit_round(plan, lines.append)
        kit_rounds.append(kit)
        if i == 0:
            for line in lines:
                say(f"  {line}")
            startup.update(
                loop_first_step_s=kit["first_step_s"], setup_s=kit["setup_s"], cpu_before_first_round_s=cpu
            )
            if age is not None:
                startup["process_to_first_step_s"] = age + kit["setup_s"] + kit["first_step_s"]
        line = f"round {i + 1}: kit {1000 * kit['steady_s'] / kit['steady_steps']:.1f} ms/step"
        if vs_plain:
            if not batches:  # the batches the kit's DataLoader yields first, already on the device
                stream = BatchStream(*data_loader(plan, o.batch_size), o.batch_size)
                batches = [next(stream)["input_ids"].to(device) for _ in range(steps * accum)]
            if plain is None:
                plain = plain_round(plain_model, batches, accum, o.learning_rate, device, plan.precision,
                                    skip)
            plain_rounds.append(plain)
            line += (
                f", plain {1000 * plain['steady_s'] / plain['steady_steps']:.1f} ms/step, "
                f"ratio {sps(kit, effective) / sps(plain, effective):.3f}"
            )
        say(line)
    result = bench_result(plan, rounds, skip, fpt, startup, kit_rounds, plain_rounds, peak)
    report(result, say)
    return result



def bench_result(
    plan: Plan,
    rounds: int,
    skip: int,
    fpt: float,
    startup: dict,
    kit_rounds: list,
    plain_rounds: list,
    peak: float | None,
) -> dict:
    """Every figure of a bench: the setting, the kit's rounds and, with --vs-plain, the plain
    loop's and the ratios."""
    import torch

    from train.core.model import count_params
    from train.tools.dryrun import tokens_per_sample

    cfg, o, device, steps = plan.cfg, plan.cfg.optim, plan.device, plan.total_steps
    effective, accum, n_params = (
        cfg.effective_batch_size(),
        o.gradient_accumulation_steps,
        count_params(plan.model),
    )
    result = {
        "model_size": plan.model_size,
        "n_params": n_params,
        "precision": plan.precision,
        "batch_size": o.batch_size,
        "gradient_accumulation_steps": accum,
        "max_length": plan.max_length,
        "num_workers": cfg.data.num_workers,
        "compile": cfg.model.compile,
        "threads": torch.get_num_threads(),
        "device": str(device),
        "device_name": result_device_name(device),
        "torch": torch.__version__,
        "rounds": rounds,
        "steps_per_round": steps,
        "warmup_steps_excluded": skip,
        "flops_per_token": fpt,
        "startup": startup,
        "kit": figures(kit_rounds, effective, tokens_per_sample(plan), fpt, peak),
        "kit_first_step_s_rounds": [r["first_step_s"] for r in kit_rounds],
        "kit_first_loss": kit_rounds[0]["first_loss"],
        "kit_final_loss": kit_rounds[-1]["final_loss"],
    }
    if cfg.model.compile:
        # the first step pays for tracing and code generation; a steady step is what is left
        startup["compile_s"] = max(0.0, startup["loop_first_step_s"] - result["kit"]["ms_per_step"] / 1000)
    if plain_rounds:
        result["plain"] = figures(plain_rounds, effective, tokens_per_sample(plan), fpt, peak)
        result["plain_first_loss"] = plain_rounds[0]["first_loss"]
        result["plain_final_loss"] = plain_rounds[-1]["final_loss"]
        # The ratio is the median over rounds of kit/plain within each round: the two halves of a
        # round ran back to back and share that moment's load, which drifts between rounds on a
        # shared machine; the ratio of the two medians is kept as well.
        result["ratio_rounds"] = [
            sps(k, effective) / sps(p, effective) for k, p in zip(kit_rounds, plain_rounds, strict=True)
        ]
        result["ratio"] = statistics.median(result["ratio_rounds"])
        result["ratio_of_medians"] = result["kit"]["samples_per_sec"] / result["plain"]["samples_per_sec"]
        # CPU seconds per step (whole rounds, set-up and warm-up included on both sides): other
        # processes' load changes wall time far more than the CPU time this process needs.
        result["cpu_time_ratio"] = result["plain"]["cpu_ms_per_step"] / result["kit"]["cpu_ms_per_step"]
    return result


def report(r: dict, say) -> None:
    def fmt(value, spec):
        return "n/a" if value is None else format(value, spec)

    say(f"{'':8}{'ms/step':>10}{'samples/s':>11}{'tokens/s':>11}{'TFLOP/s':>9}{'MFU':>7}{'CPU ms/step':>13}")
    for side in ("kit", "plain"):
        if side in r:
            f = r[side]
            say(
                f"{side:8}{f['ms_per_step']:10.1f}{f['samples_per_sec']:11.2f}{f['tokens_per_sec']:11,.0f}"
                f"{f['achieved_tflops']:9.4f}{fmt(f['mfu'], '.1%'):>7}{f['cpu_ms_per_step']:13.1f}"
            )
    if "ratio" in r:
        say(
            f"ratio kit/plain (samples/s, median of {r['rounds']} rounds' ratios): {r['ratio']:.3f}; "
            f"ratio of the medians {r['ratio_of_medians']:.3f}; CPU-time ratio {r['cpu_time_ratio']:.3f}"
        )
    s = r["startup"]
    line = f"first step: {s['loop_first_step_s']:.2f} s after the loop starts"
    if "compile_s" in s:
        line += f" (torch.compile about {s['compile_s']:.1f} s of it)"
    if "process_to_first_step_s" in s:
        line += f"; {s['process_to_first_step_s']:.1f} s from process start (build {s['build_s']:.1f} s)"
    say(line)


def bench_main(argv: list[str]) -> int:
    from train.config.flags import parse_training_args, training_parser

    if any(a in ("-h", "--help") for a in argv):
        bench_parser().print_help()
        print()
        training_parser("bench").print_help()
        return 0
    args, rest = bench_parser().parse_known_args(argv)
    rounds = _whole("rounds", args.rounds, 1)
    threads = _whole("threads", args.threads, 1)
    cfg = parse_training_args("pretrain", rest)
    try:
        result = run_bench(cfg, rounds, args.vs_plain, threads)
    except KeyboardInterrupt:
        print("bench interrupted")
        return 130
    if args.json:
        files.atomic_write(args.json, json.dumps(result, indent=2) + "\n")
    return 0
