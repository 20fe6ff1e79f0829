"""doctor: a short profiled run of your own config, the guides' verdict, and (--apply) the fix tried.

The run is a real training run of DOCTOR_STEPS steps (runs/doctor-...), so its numbers are the
ones training would show: samples/s, the share of step time spent waiting for data, GPU
utilisation (NVML), peak memory against what the process can use (peak reserved VRAM on a GPU,
peak RSS on CPU, against MAX_MEMORY_MB where set), host RAM and swap. The verdict is the first
rule that applies, in the order a run fails or wastes the most:

  host-RAM pressure (RAM >= 90 % or swap >= 10 %, with workers or pinned memory): fewer workers
  memory-bound (peak >= 90 % of the memory, or the run ran out): preference training's frozen
      copy replaced by REFERENCE=precomputed (the same losses, one model), then bf16/fp16, then
      gradient checkpointing, then a shorter MAX_LENGTH
  input-bound (data wait >= 20 % of step time): more workers, pinned memory, persistent workers
  compute-bound with memory to spare (peak < 70 %): a larger BATCH_SIZE, GRADIENT_ACCUM lowered
      to keep the effective batch
  compute-bound within the band: mixed precision if the run is fp32; otherwise nothing to change

`doctor dpo ...` (or sft) profiles that mode's run: preference training's own step, its rates in pairs.
"""

from __future__ import annotations

import argparse
import copy
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from train.config import knobs
from train.core.device import resolve_device, supports
from train.core.errors import UsageError
from train.core.files import write_json
from train.core.measure.timing import INPUT_BOUND_FRAC
from train.core.units import cpu_cores
from train.observe import monitor
from train.run.plan.adapt import PeakMeter, capacity_mb
from train.run.rundir.claim import plan_run_dir
from train.tools.tool_args import unit_of

DOCTOR_STEPS = 10
MEMORY_BOUND = 0.90  # peak at or above this share of the memory: memory-bound
ROOM = 0.70  # under the low end of the guides' 70-85 % band: memory to spare
RAM_PRESSURE_PCT = 90.0
SWAP_PRESSURE_PCT = 10.0
FASTER = 1.03  # a fix has to beat the run-to-run noise of one thread (bench/RESULTS.md: about 1.5 %)


@dataclass
class Reading:
    run: str
    exit_reason: str
    precision: str
    max_length: int
    samples_per_sec: float | None
    data_wait_frac: float | None
    gpu_util: float | None
    peak_mb: float | None
    capacity_mb: float | None
    capacity_source: str
    ram_used_pct: float | None
    swap_used_pct: float | None
    mode: str = "pretrain"
    reference: str | None = None  # preference training's (summary.json's)

    @property
    def memory_frac(self) -> float | None:
        return self.peak_mb / self.capacity_mb if self.peak_mb and self.capacity_mb else None


@dataclass
class Verdict:
    kind: str
    why: str
    changes: dict = field(default_factory=dict)  # config field -> value to try


def profile(cfg, steps: int, label: str) -> Reading:
    """Run `steps` real training steps of cfg (a copy) in a new run folder and read the numbers."""
    from train.run.pipeline import train

    run_cfg = copy.deepcopy(cfg)
    o = run_cfg.optim
    o.max_steps, o.epochs, o.max_samples, o.auto_batch = steps, None, None, False
    run_cfg.run.log_every = steps
    run_cfg.run.launcher = f"doctor-{label}"
    run_path = plan_run_dir(run_cfg.run.output_dir, None, run_cfg.run.launcher, False)
    run_cfg.run.run_name = run_path.name
    device, _ = resolve_device(cfg.system.device)
    capacity, source = capacity_mb(device, cfg.system.max_memory_mb)
    meter = PeakMeter(device)
    meter.reset()
    train(run_cfg)
    summary = json.loads((run_path / "summary.json").read_text())
    peak = summary.get("peak_vram_reserved_mb") if device.type == "cuda" else meter.peak_mb()
    host = monitor.host_memory()
    return Reading(str(run_path), summary["exit_reason"], summary["precision"], summary["max_length"],
                   summary["samples_per_sec"],
                   summary["data_wait_frac"], summary.get("avg_gpu_util"), peak, capacity, source,
                   host.get("ram_used_pct"), host.get("swap_used_pct"), summary.get("mode", cfg.run.mode),
                   summary.get("reference"))


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0%}"


def diagnose(r: Reading, cfg) -> Verdict:
    d, o, m = cfg.data, cfg.optim, cfg.model
    device, _ = resolve_device(cfg.system.device)
    frac = r.memory_frac
    memory = (
        f"peak {r.peak_mb:.0f} MB = {_pct(frac)} of {r.capacity_mb:.0f} MB ({r.capacity_source})"
        if frac
        else "memory n/a"
    )
    ram, swap = r.ram_used_pct or 0.0, r.swap_used_pct or 0.0
    if (ram >= RAM_PRESSURE_PCT or swap >= SWAP_PRESSURE_PCT) and (d.num_workers > 0 or d.pin_memory):
        why = f"host RAM {ram:.0f} % used, swap {swap:.0f} %: each worker is a copy of the process"
        change = {"num_workers": d.num_workers // 2} if d.num_workers > 0 else {"pin_memory": False}
        return Verdict("host-RAM pressure", why, change)
    if r.exit_reason == "out_of_memory" or (frac is not None and frac >= MEMORY_BOUND):
        why = "ran out of memory" if r.exit_reason == "out_of_memory" else (f"{memory}, over "
                                                                            f"{MEMORY_BOUND:.0%}")
        if r.reference == "copy":
            return Verdict("memory-bound", why + ": a frozen copy of the model sits beside it; precomputed "
                                                 "reference "
                           "log-probs give the same losses with one model", {"reference": "precomputed"})
        if r.precision == "fp32" and supports(device, "bf16"):
            return Verdict("memory-bound", why + ": bf16 halves activation memory", {"precision": "bf16"})
        if r.precision == "fp32" and supports(device, "fp16"):
            return Verdict("memory-bound", why + ": fp16 halves activation memory", {"precision": "fp16"})
        if not m.gradient_checkpointing:
            return Verdict(
                "memory-bound", why + ": recompute activations in backward", {"gradient_checkpointing": True}
            )
        return Verdict(
            "memory-bound",
            why + ": attention memory grows with length",
            {"max_length": max(2, r.max_length // 2)},
        )
    if r.data_wait_frac is not None and r.data_wait_frac >= INPUT_BOUND_FRAC:
        why = (f"{r.data_wait_frac:.0%} of step time waiting for data (over {INPUT_BOUND_FRAC:.0%}); GPU "
               f"{_pct_util(r)}")
        cores = cpu_cores()
        if d.num_workers < cores:
            change = {"num_workers": min(cores, max(2, 2 * d.num_workers))}
            if device.type == "cuda" and not d.pin_memory:
                change["pin_memory"] = True
            if not d.persistent_workers:
                change["persistent_workers"] = True
            return Verdict("input-bound", why, change)
        if not d.persistent_workers:
            return Verdict("input-bound", why, {"persistent_workers": True})
        return Verdict("input-bound", why + f"; workers already at the {cores} CPU cores: the dataset itself "
                                            f"is slow", {})
    if frac is not None and frac < ROOM:
        change = {"batch_size": 2 * o.batch_size}
        why = f"{memory}, under {ROOM:.0%}"
        if o.gradient_accumulation_steps % 2 == 0:
            change["gradient_accumulation_steps"] = o.gradient_accumulation_steps // 2
        else:
            why += (f"; the effective batch doubles to {2 * o.batch_size * o.gradient_accumulation_steps} "
                    f"(LR_SCALING adjusts the LR)")
        return Verdict(
            "compute-bound, memory to spare", why + "; make find-batch finds the largest that fits", change
        )
    if r.precision == "fp32" and supports(device, "bf16"):
        return Verdict("compute-bound", f"{memory}; GPU {_pct_util(r)}: mixed precision is the largest "
                                        f"single win",
                       {"precision": "bf16"})
    return Verdict("balanced", f"{memory}; GPU {_pct_util(r)}; data wait {_pct(r.data_wait_frac)}: nothing "
                               f"to change")


def _pct_util(r: Reading) -> str:
    return "util n/a (no NVML GPU)" if r.gpu_util is None else f"{r.gpu_util:.0f} % busy"


def variables(changes: dict) -> str:
    """{field: value} as the launcher variables to set: NUM_WORKERS=2 PRECISION=bf16."""
    def text(value):
        return str(int(value)) if isinstance(value, bool) else str(value)

    return " ".join(f"{knobs.env_name(k)}={text(v)}" for k, v in changes.items())


def with_changes(cfg, changes: dict):
    new = copy.deepcopy(cfg)
    for name, value in changes.items():
        knobs.set_value(new, name, value)
    if new.data.num_workers == 0:
        new.data.prefetch_factor, new.data.persistent_workers = None, False
    return new


def report(r: Reading) -> list[str]:
    rate = "n/a" if r.samples_per_sec is None else f"{r.samples_per_sec:.1f}"
    peak = "n/a" if r.peak_mb is None else f"{r.peak_mb:.0f} MB"
    cap = "n/a" if r.capacity_mb is None else f"{r.capacity_mb:.0f} MB ({r.capacity_source})"
    return [
        f"  {unit_of(r.mode) + '/s':<13} {rate}",
        f"  data wait     {_pct(r.data_wait_frac)} of step time",
        f"  GPU           {_pct_util(r)}",
        f"  memory        {peak} = {_pct(r.memory_frac)} of {cap}",
        f"  host RAM      {'n/a' if r.ram_used_pct is None else f'{r.ram_used_pct:.0f} %'} used, "
        f"swap {'n/a' if r.swap_used_pct is None else f'{r.swap_used_pct:.0f} %'}",
    ]


def compare(before: Reading, after: Reading, verdict: Verdict) -> tuple[list[str], str]:
    def row(name, a, b):
        return f"  {name:<12} {a:>12} {b:>12}"

    def rate(r):
        return "n/a" if r.samples_per_sec is None else f"{r.samples_per_sec:.1f}"

    lines = [row("", "before", "after"), row(f"{unit_of(before.mode)}/s", rate(before), rate(after)),
             row("data wait", _pct(before.data_wait_frac), _pct(after.data_wait_frac)),
             row("memory", _pct(before.memory_frac), _pct(after.memory_frac)),
             row("GPU busy", _pct_util(before)[:12], _pct_util(after)[:12])]
    fix = variables(verdict.changes)
    if after.exit_reason != "completed":
        return lines, f"the fix did not complete ({after.exit_reason}): keep your settings"
    if verdict.kind == "memory-bound":
        if before.exit_reason == "out_of_memory" or (after.memory_frac or 1) < (before.memory_frac or 0):
            return lines, f"memory {_pct(before.memory_frac)} -> {_pct(after.memory_frac)}: keep {fix}"
        return lines, (f"memory did not drop ({_pct(before.memory_frac)} -> {_pct(after.memory_frac)}): try "
                       f"the next remedy")
    speedup = (after.samples_per_sec or 0) / before.samples_per_sec if before.samples_per_sec else None
    if speedup is not None and speedup >= FASTER:
        return lines, f"{speedup:.2f}x {unit_of(before.mode)}/s: keep {fix}"
    return lines, f"not faster here ({'n/a' if speedup is None else f'{speedup:.2f}x'}): keep your settings"


def doctor_main(argv: list[str]) -> int:
    """`python -m train doctor [--apply] [--steps N] [training flags]`."""
    from train.config.flags import parse_training_args
    from train.tools.tool_args import mode_of, wants_help

    if wants_help(
        "doctor",
        "profile a short run of your settings, say what limits it and what to change, "
        "and with --apply try the change",
        argv,
        (
            ("--apply", "run the suggested change as a second profiled run and show before/after"),
            ("--steps N", f"optimizer steps per profiled run (default {DOCTOR_STEPS}, at least 2)"),
        ),
    ):
        return 0
    parser = argparse.ArgumentParser(prog="python -m train doctor", add_help=False, allow_abbrev=False)
    parser.add_argument("--apply", action="store_true", help="run the suggested fix and show before/after")
    parser.add_argument("--steps", default=str(DOCTOR_STEPS), help=f"optimizer steps per profiled run "
                                                                   f"({DOCTOR_STEPS})")
    mine, rest = parser.parse_known_args(argv)
    if not mine.steps.isdigit() or int(mine.steps) < 2:
        raise UsageError(f"doctor --steps: expected a whole number >= 2, got {mine.steps!r}")
    mode, rest = mode_of(rest, "doctor")
    cfg = parse_training_args(mode, rest)
    steps = int(mine.steps)
    print(f"doctor: profiling {steps} steps of your {mode} config")
    before = profile(cfg, steps, "before")
    verdict = diagnose(before, cfg)
    out = [f"doctor: {before.run}", *report(before), f"verdict: {verdict.kind}: {verdict.why}"]
    out.append(f"try: {variables(verdict.changes)}" if verdict.changes else "try: nothing")
    print("\n".join(out))
    record = {"before": asdict(before), "verdict": asdict(verdict), "try": variables(verdict.changes)}
    if mine.apply and verdict.changes:
        print(f"doctor: applying {variables(verdict.changes)}")
        after = profile(with_changes(cfg, verdict.changes), steps, "after")
        lines, conclusion = compare(before, after, verdict)
        print("\n".join([f"doctor: before {before.run}, after {after.run}", *lines, f"result: {conclusion}"]))
        record.update(after=asdict(after), result=conclusion)
    write_json(Path(before.run) / "doctor.json", record)
    return 0
