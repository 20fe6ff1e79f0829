"""autotune: short timed trials of the real loop over micro-batch x accumulation (the effective batch
fixed), DataLoader workers, precision and torch.compile; a ranked table; the winner written as
launcher variables.

Each trial is the run's own code: build(), build_optimizer, the real DataLoader (workers, prefetch,
pinned memory) and train_step, one warm-up step (worker start-up, compilation, allocator) and
TRIAL_STEPS timed optimizer steps. The full grid (3 precisions x 5 sizes x 4 worker counts x 2)
is too long for "short", so the search is coordinate descent from the OPTIMIZED preset: one
dimension at a time (precision, micro-batch, workers, compile), keeping the best so far.

The preset's own settings (its micro-batch, or the largest divisor of the effective batch under
it) are always the first trial, and the best alternative is re-measured side by side with it at
the end; the winner is the faster on the mean of its measurements. So the winner is at least as
fast as the OPTIMIZED preset on this machine by construction: when nothing beats it, the preset
wins. Trials that run out of memory or go over TARGET_VRAM are shown and never win.

A mode (`autotune sft ...`, `autotune dpo ...`) starts from its launcher's preset (PRESET_OF) and times
its own step: preference training's trials run the preference objective with the plan's reference, in
pairs per second.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from train.config import knobs
from train.core import files
from train.core.device import device_name, resolve_device, resolve_precision, supports, synchronize
from train.core.errors import UsageError
from train.core.units import cpu_cores
from train.run.compile.choose import compile_default
from train.run.loop.oom import free_memory, is_oom
from train.run.plan.adapt import PeakMeter, capacity_mb
from train.tools.find_batch import divisors
from train.tools.tool_args import mode_of, unit_of, wants_help

TRIAL_STEPS = 2
CONFIRM = 3  # side-by-side re-measurements of the leader against the preset
DIMENSIONS = ("precision", "batch", "workers", "compile")
ENV_FILE = "autotune.env"  # in OUTPUT_DIR: VAR=value lines this module writes (ints and fixed words only)
LAUNCHER_OF = {
    "pretrain": "run_single_gpu_optimized.sh",
    "sft": "quick_start_sft_fast.sh",
    "dpo": "train_dpo.sh",
}
PRESET_OF = {"pretrain": "optimized", "sft": "sft", "dpo": "dpo"}  # the first trial's settings, by mode
WRITTEN = ("batch_size", "gradient_accumulation_steps", "num_workers", "prefetch_factor", "pin_memory",
           "persistent_workers", "precision", "compile", "tf32")


@dataclass(frozen=True)
class Candidate:
    batch_size: int
    gradient_accumulation_steps: int
    num_workers: int
    precision: str
    compile: bool
    preset: str = ""  # the preset it is (PRESET_OF's): its other DataLoader and TF32 settings apply too

    def label(self) -> str:
        name = (f"{self.batch_size} x {self.gradient_accumulation_steps}, {self.num_workers} workers, "
                f"{self.precision}")
        return (
            name + (", compile" if self.compile else "") + (f" ({self.preset} preset)" if self.preset else "")
        )


@dataclass
class Outcome:
    candidate: Candidate
    status: str = "ok"  # ok | over target | out of memory | failed: ...
    rates: list = field(default_factory=list)  # samples/s of each measurement
    data_wait_frac: float | None = None
    peak_mb: float | None = None
    loss: float | None = None  # the warm-up step's: the objective that ran (ln 2 at a preference run's start)

    @property
    def samples_per_sec(self) -> float | None:
        return statistics.mean(self.rates) if self.rates and self.status == "ok" else None


def trial_config(cfg, cand: Candidate):
    """The user's config with the candidate's settings (and the preset's, for the preset)."""
    new = copy.deepcopy(cfg)
    if cand.preset:
        for name, value in knobs.preset(cand.preset).items():
            knobs.set_value(new, name, value)
    new.optim.batch_size, new.optim.gradient_accumulation_steps = (
        cand.batch_size,
        cand.gradient_accumulation_steps,
    )
    new.optim.effective_batch, new.optim.auto_batch, new.optim.lr_scaling = None, False, "none"
    new.data.num_workers, new.system.precision, new.model.compile = (
        cand.num_workers,
        cand.precision,
        cand.compile,
    )
    if cand.num_workers == 0:
        new.data.prefetch_factor, new.data.persistent_workers = None, False
    return new


def measure(cfg, cand: Candidate, steps: int, limit: float | None) -> Outcome:
    """Time `steps` optimizer steps of the real loop with this candidate, after one warm-up step."""
    from train.core.optim.registry import build_optimizer
    from train.core.step import train_step
    from train.data.stream import BatchStream
    from train.distributed.parallel import build_scaler
    from train.run.loop.parts import data_loader
    from train.run.plan.build import build

    plan = build(trial_config(cfg, cand), lambda line: None)
    device, effective = plan.device, cand.batch_size * cand.gradient_accumulation_steps
    optimizer, _ = build_optimizer(plan.cfg.optim, plan.model, device)
    scaler = build_scaler(plan.precision, plan.model, device)
    loader, sampler = data_loader(plan, plan.cfg.optim.batch_size)
    batches = BatchStream(loader, sampler, cand.batch_size)
    meter = PeakMeter(device)
    meter.reset()
    outcome, spent, waited, error, first = Outcome(cand), 0.0, 0.0, None, None
    try:
        step_model = torch.compile(plan.model) if cand.compile else plan.model
        for i in range(1 + steps):
            synchronize(device)
            start = time.perf_counter()
            loss, _, wait = train_step(
                step_model,
                optimizer,
                scaler,
                batches,
                cand.gradient_accumulation_steps,
                plan.cfg.optim.grad_clip,
                device,
                plan.precision,
                layout=plan.family.layout,
                objective=plan.objective,
            )
            synchronize(device)
            if i:  # the first step pays for worker start-up and compilation
                spent, waited = spent + time.perf_counter() - start, waited + wait
            first = loss.detach() if first is None else first
    except Exception as err:
        if not (is_oom(err) or cand.compile):  # compile may fail for want of a compiler: a result
            raise
        error = "out of memory" if is_oom(err) else f"failed: {type(err).__name__}"
    finally:
        batches.close()  # ends the loader's iterator and its worker processes
    peak = meter.peak_mb()
    del plan, optimizer, loader
    free_memory(device)
    if error:
        outcome.status = error
        return outcome
    outcome.rates.append(steps * effective / spent)
    outcome.data_wait_frac, outcome.peak_mb = min(1.0, waited / spent), peak
    outcome.loss = float(first)  # read after the timed steps: no sync among them
    if limit is not None and peak is not None and peak > limit:
        outcome.status = "over target"
    return outcome


def preset_candidate(effective: int, cores: int, name: str = "optimized") -> Candidate:
    p = knobs.preset(name)
    size = max(d for d in divisors(effective) if d <= p["batch_size"])
    workers = min(p.get("num_workers", knobs.default("num_workers")), cores)
    return Candidate(size, effective // size, workers, p.get("precision", knobs.default("precision")),
                     bool(p.get("compile", knobs.default("compile"))), preset=name)


def neighbours(cur: Candidate, dim: str, effective: int, device, cores: int) -> list[Candidate]:
    """The current best with one dimension changed (never the current best itself again)."""
    base = replace(cur, preset="")
    if dim == "precision":
        found = [replace(base, precision=p) for p in ("fp32", "bf16", "fp16") if supports(device, p)]
    elif dim == "batch":
        sizes = {
            max(d for d in divisors(effective) if d <= max(1, cur.batch_size * f)) for f in (0.25, 0.5, 2, 4)
        }
        found = [
            replace(base, batch_size=s, gradient_accumulation_steps=effective // s) for s in sorted(sizes)
        ]
    elif dim == "workers":
        found = [replace(base, num_workers=w) for w in sorted({0, 2, 4, cores}) if w <= cores]
    else:
        found = [replace(base, compile=not cur.compile)]
    return [c for c in found if c != base]


def tune(cfg, say, steps: int = TRIAL_STEPS, skip: tuple = ()) -> tuple[Outcome, Outcome, list[Outcome]]:
    """Returns (winner, preset, every outcome)."""
    device, _ = resolve_device(cfg.system.device)
    cores = cpu_cores()
    effective = cfg.optim.effective_batch or cfg.effective_batch_size()
    capacity, _ = capacity_mb(device, cfg.system.max_memory_mb)
    limit = None if capacity is None else cfg.system.target_vram * capacity
    seen: dict[Candidate, Outcome] = {}

    def run(cand: Candidate) -> Outcome:
        if cand not in seen:
            seen[cand] = measure(cfg, cand, steps, limit)
            o = seen[cand]
            say(f"  {cand.label():<48} {o.samples_per_sec or 0:8.1f} {unit_of(cfg.run.mode)}/s  {o.status}")
        return seen[cand]

    def faster(a: Outcome, b: Outcome) -> Outcome:
        return a if (a.samples_per_sec or -1) > (b.samples_per_sec or -1) else b

    say(f"autotune: {cfg.run.mode}, effective batch {effective} {unit_of(cfg.run.mode)}, {steps} timed steps "
        f"per trial, on {device_name(device)}")
    preset = run(preset_candidate(effective, cores, PRESET_OF[cfg.run.mode]))
    o = cfg.optim
    if effective % o.batch_size == 0:  # the user's own settings, when they keep the effective batch
        precision, _ = resolve_precision(cfg.system.precision, device)
        compiled = cfg.model.compile  # empty: the run's own default (train/run/compile/choose.py)
        if compiled is None:
            compiled = compile_default(device, cfg.system.sharding)[0]
        mine = Candidate(o.batch_size, effective // o.batch_size, min(cfg.data.num_workers, cores), precision,
                         compiled)
        if mine != replace(preset.candidate, preset=""):
            run(mine)
    best = max(seen.values(), key=lambda x: x.samples_per_sec or -1)
    for dim in DIMENSIONS:
        if dim in skip:
            continue
        for cand in neighbours(best.candidate, dim, effective, device, cores):
            best = faster(run(cand), best)
    # One timing can be lucky: the top of the table is re-measured side by side with the preset
    # until the top is the preset or has been measured twice (at most CONFIRM rounds).
    for _ in range(CONFIRM):
        best = max(seen.values(), key=lambda x: x.samples_per_sec or -1)
        if best is preset or best.samples_per_sec is None or len(best.rates) > 1:
            break
        say(f"autotune: re-measuring {best.candidate.label()} and the preset, side by side")
        for outcome in (preset, best):
            again = measure(cfg, outcome.candidate, steps, limit)
            outcome.rates += again.rates
            if again.status != "ok":
                outcome.status = again.status
    confirmed = [o for o in seen.values() if len(o.rates) > 1 or o is preset]
    best = max(confirmed, key=lambda x: x.samples_per_sec or -1)
    best = faster(best, preset)  # a tie goes to the preset
    if best.samples_per_sec is None:
        raise UsageError("autotune: no trial completed (all ran out of memory or over TARGET_VRAM); try make "
                         "find-batch")
    return best, preset, list(seen.values())


def table(
    outcomes: list[Outcome], winner: Outcome, preset: Outcome, limit_note: str, unit: str = "samples"
) -> list[str]:
    """Ranked by mean samples (pairs) /s; the winner is the top among those measured twice (or the preset)."""
    ranked = sorted(outcomes, key=lambda x: (x is not winner, -(x.samples_per_sec or -1)))
    ref = preset.samples_per_sec
    lines = [f"{'rank':>4}  {'micro x accum, workers, precision':<48} {unit + '/s':>10} {'vs preset':>10} "
             f"{'data wait':>9} {'peak MB':>8} {'runs':>4}  result"]
    for i, o in enumerate(ranked, 1):
        rate = o.samples_per_sec
        lines.append(
            f"{i:>4}  {o.candidate.label():<48} {'-' if rate is None else f'{rate:.1f}':>10} "
            f"{'-' if not (rate and ref) else f'{rate / ref:.2f}x':>10} "
            f"{'-' if o.data_wait_frac is None else f'{o.data_wait_frac:.0%}':>9} "
            f"{'-' if o.peak_mb is None else f'{o.peak_mb:.0f}':>8} {len(o.rates):>4}  "
            f"{'winner' if o is winner else o.status}"
        )
    lines.append(limit_note)
    return lines


def write_env(path: Path, cfg, winner: Outcome, preset: Outcome) -> list[str]:
    """The winner's settings as launcher variables (`set -a; . runs/autotune.env; set +a`)."""
    full = trial_config(cfg, winner.candidate)
    pairs = []
    for name in WRITTEN:
        value = knobs.value(full, name)
        if value is not None:
            pairs.append(f"{knobs.env_name(name)}={int(value) if isinstance(value, bool) else value}")
    ref = preset.samples_per_sec
    head = (
        f"# python -m train autotune {cfg.run.mode}, {time.strftime('%Y-%m-%d %H:%M')}: "
        f"{winner.samples_per_sec:.1f} {unit_of(cfg.run.mode)}/s"
        + (
            f", {winner.samples_per_sec / ref:.2f}x the {preset.candidate.preset} preset ({ref:.1f})"
            if ref
            else ", the preset failed"
        )
        + f"; effective batch {full.effective_batch_size()}"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    files.atomic_write(path, "\n".join([head, *pairs]) + "\n")
    return pairs


def autotune_main(argv: list[str]) -> int:
    """`python -m train autotune [--steps N] [--skip compile,workers] [training flags]`."""
    from train.config.flags import parse_training_args

    if wants_help("autotune", "time short trials of batch x accumulation, workers, precision and compile, "
                  "rank them and write the winner to OUTPUT_DIR/autotune.env", argv, (
                      ("--steps N", f"optimizer steps per trial (default {TRIAL_STEPS})"),
                      ("--skip LIST", f"dimensions to leave as they are, comma-separated: "
                                      f"{','.join(DIMENSIONS)}"))):
        return 0
    parser = argparse.ArgumentParser(prog="python -m train autotune", add_help=False, allow_abbrev=False)
    parser.add_argument("--steps", default=str(TRIAL_STEPS))
    parser.add_argument("--skip", default="", help=f"dimensions to leave as they are: {','.join(DIMENSIONS)}")
    mine, rest = parser.parse_known_args(argv)
    skip = tuple(s for s in mine.skip.split(",") if s)
    if not mine.steps.isdigit() or int(mine.steps) < 1 or set(skip) - set(DIMENSIONS):
        raise UsageError(f"autotune: --steps takes a whole number >= 1 and --skip some of "
                         f"{','.join(DIMENSIONS)}")
    mode, rest = mode_of(rest, "autotune")
    cfg = parse_training_args(mode, rest)
    winner, preset, outcomes = tune(cfg, print, int(mine.steps), skip)
    note = (f"(TARGET_VRAM {cfg.system.target_vram:g}; each rate the mean of its runs; a single run never "
            f"wins)")
    print("\n".join(table(outcomes, winner, preset, note, unit_of(cfg.run.mode))))
    path = Path(cfg.run.output_dir) / ENV_FILE
    pairs = write_env(path, cfg, winner, preset)
    print(f"winner: {winner.candidate.label()}, {winner.samples_per_sec:.1f} {unit_of(cfg.run.mode)}/s")
    print(f"written to {path}; use: {' '.join(pairs)} ./{LAUNCHER_OF[cfg.run.mode]}")
    return 0
