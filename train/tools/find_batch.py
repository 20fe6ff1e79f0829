"""find-batch: the fastest micro-batch that fits, measured with real training steps.

How: the model, optimizer and step of a real run (build, build_optimizer, train_step) at the
worst-case length (every packed sequence is MAX_LENGTH tokens long), at micro-batches growing by
doubling, then a binary search between the last size that fit and the first that did not.
A size fits when its steps run and their peak memory stays under TARGET_VRAM x the memory this
process can use (train/run/plan/adapt.py: peak reserved VRAM on a GPU; peak RSS against MAX_MEMORY_MB or
the reachable host RAM on CPU). An out-of-memory error at size F also caps the answer at
TARGET_VRAM x F: activation memory grows with the micro-batch, and a size just under a crash has
no headroom for fragmentation or a spike later in the run. Each size's samples/s is measured and
the fastest safe size wins (within TIE of the fastest, the smaller one: same speed, more room).

Only divisors of the effective batch are tried, so GRADIENT_ACCUM = EFFECTIVE_BATCH / BATCH_SIZE
keeps the effective batch exactly. Under torchrun, rank 0 searches and broadcasts the result.

Preference training (`find-batch dpo ...`, or AUTO_BATCH=1 in a dpo run): the micro-batch counts
pairs, each trial step is the run's own (the preference objective with the reference the plan chose:
a frozen copy on the device, the precomputed log-probs the batches carry, or the adapters switched
off), on the longest pairs of the data (a batch of them is the widest the run can meet). Reward training
(`find-batch grpo`): prompts, each trial step the run's own, sampling the longest prompts' completions;
those that stop early hold less than MAX_COMPLETION_LENGTH, so the estimate beside the answer counts more.
"""

from __future__ import annotations

import copy
import gc
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from train.core.device import device_name, synchronize
from train.core.errors import UsageError
from train.core.units import MIB
from train.distributed.process_group import SINGLE, Dist
from train.run.loop.oom import free_memory, is_oom, remedies
from train.run.plan.adapt import PeakMeter, capacity_mb

# (RESULT_FILE, read_saved: the tests' names)
from train.run.plan.batch_answer import RESULT_FILE, read_saved, settings_key  # noqa: F401
from train.run.plan.fill import estimated_fit
from train.run.plan.make import Chosen
from train.tools.tool_args import MODES, mode_of, unit_of, wants_help

if TYPE_CHECKING:
    from train.run.plan.make import Plan

TRIAL_STEPS = 2  # timed optimizer steps per size, after one warm-up step (allocator, optimizer state)
TIE = 0.03  # sizes within 3 % of the fastest count as equally fast: the smallest of them wins


@dataclass
class Trial:
    batch_size: int
    status: str  # fits | over target | out of memory | skipped
    peak_mb: float | None = None
    samples_per_sec: float | None = None
    loss: float | None = None  # the first step's: the objective that ran (ln 2 at a preference run's start)


@dataclass
class Result:
    batch_size: int
    gradient_accumulation_steps: int
    effective_batch: int
    largest_safe: int
    limit_mb: float
    capacity_mb: float
    capacity_source: str
    samples_per_sec: float | None = None
    peak_mb: float | None = None
    trials: list = field(default_factory=list)
    source: str = "searched"
    unit: str = "samples"  # what a micro-batch counts: samples (sequences) or pairs (preference training)
    objective: str = "token loss"


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _sampler(dataset, seed: int, seq2seq_lengths: tuple[int, int] | None = None, vocab: int = 0,
             max_length: int = 0):
    """Real packed windows (all MAX_LENGTH tokens: the worst case) drawn at random. An
    encoder-decoder: batches of the seq2seq contract at the worst-case lengths (a full source,
    the mode's target: train/models/estimate_seq2seq.lengths), random tokens: memory and time
    depend on the shapes only."""
    generator = torch.Generator().manual_seed(seed)
    if seq2seq_lengths is not None:
        source, target = seq2seq_lengths

        def contract(size: int) -> dict:
            return {
                "input_ids": torch.randint(1, vocab, (size, source), generator=generator),
                "attention_mask": torch.ones(size, source, dtype=torch.long),
                "labels": torch.randint(1, vocab, (size, target), generator=generator),
            }

        return contract

    if not torch.is_tensor(dataset[0]["input_ids"]):  # SFT: conversations of every length (lists of ids)
        def worst(size: int) -> dict:  # the worst case, full rows of MAX_LENGTH tokens, all trained
            return {"input_ids": torch.randint(1, vocab, (size, max_length), generator=generator)}

        return worst

    def sample(size: int) -> dict:
        picks = torch.randint(len(dataset), (size,), generator=generator).tolist()
        return {"input_ids": torch.stack([dataset[i]["input_ids"] for i in picks])}

    return sample


def _longest_pairs(dataset, collate):
    """Batches of the data's longest pairs (PairDataset.lengths, the samplers' cost), collated as the
    run collates them (with the precomputed reference's log-probs where the plan made them)."""
    order = np.argsort(-np.asarray(dataset.lengths), kind="stable")

    def pairs(size: int) -> dict:
        return collate([dataset[int(order[i % len(order)])] for i in range(size)])

    return pairs


def objective_of(plan: Plan) -> str:
    """What a trial step runs, in words (the Result's and the log's): the objective's, and its reference
    model."""
    reference = plan.cfg.model.reference
    return plan.objective.describe() + (f", reference {reference}" if reference else "")


def _trial(step_model, optimizer, scaler, plan: Plan, sample, size: int, steps: int,
           meter: PeakMeter) -> Trial:
    from train.core.step import train_step

    device, precision = plan.device, plan.precision
    meter.reset()
    times, failed, first = [], False, None
    try:
        for _ in range(1 + steps):
            batch = sample(size)
            synchronize(device)
            start = time.perf_counter()
            loss, *_ = train_step(
                step_model,
                optimizer,
                scaler,
                iter([batch]),
                1,
                plan.cfg.optim.grad_clip,
                device,
                precision,
                layout=plan.family.layout,
                objective=plan.objective,
            )
            synchronize(device)
            times.append(time.perf_counter() - start)
            first = loss.detach() if first is None else first
    except Exception as err:  # anything but OOM is a real error
        if not is_oom(err):
            raise
        failed = True
    if failed:  # freed outside the except block, once the traceback's frames are gone
        free_memory(device, optimizer)
        if hasattr(scaler, "_per_optimizer_states"):
            scaler._per_optimizer_states.clear()
        return Trial(size, "out of memory")
    value = float(first)  # read once the timed steps are done: no sync among them
    return Trial(
        size,
        "fits",
        meter.peak_mb(),
        size / statistics.median(times[1:]),
        value if math.isfinite(value) else None,
    )


def _predict(trials: list[Trial], size: int) -> float | None:
    """Peak memory at `size` from the two largest sizes that ran (memory is linear in the batch)."""
    ran = sorted(
        (t for t in trials if t.peak_mb is not None and t.status != "skipped"), key=lambda t: t.batch_size
    )
    if len(ran) < 2:
        return None
    a, c = ran[-2], ran[-1]
    slope = (c.peak_mb - a.peak_mb) / (c.batch_size - a.batch_size)
    return c.peak_mb + max(0.0, slope) * (size - c.batch_size)


def search(
    plan: Plan, effective: int, limit: float, capacity: float, say, steps: int = TRIAL_STEPS
) -> tuple[int, list[Trial]]:
    """Trials over the divisors of `effective` (per process); returns (largest safe size, trials).
    The largest safe size is 0 when even a micro-batch of 1 does not fit."""
    from train.core.optim.registry import build_optimizer
    from train.distributed.parallel import build_scaler
    from train.tools.dryrun import run_lengths

    optimizer, _ = build_optimizer(plan.cfg.optim, plan.model, plan.device)
    scaler = build_scaler(plan.precision, plan.model, plan.device)
    step_model = torch.compile(plan.model) if plan.cfg.model.compile else plan.model
    if plan.objective.trial_on_longest:  # e.g. preference pairs, through the run's collator
        sample = _longest_pairs(plan.dataset, plan.collate)
    else:
        # an encoder-decoder: the run's two lengths
        lengths = plan.family.layout.pick(None, run_lengths(plan))
        sample = _sampler(plan.dataset, plan.cfg.system.seed, lengths, plan.model.config.vocab_size,
                          plan.max_length)
    meter = PeakMeter(plan.device)
    sizes, trials = divisors(effective), []
    # Never try a size predicted past halfway between the target and the whole capacity: on CPU
    # the OOM killer, unlike a CUDA OOM, cannot be caught.
    ceiling = (limit + capacity) / 2
    say(f"{'micro-batch':>12} {'peak MB':>9} {'of limit':>9} {unit_of(plan.cfg.run.mode) + '/s':>10}  result")

    def run(size: int) -> bool:
        predicted = _predict(trials, size)
        if predicted is not None and predicted > ceiling:
            trial = Trial(size, "skipped", predicted)
        else:
            trial = _trial(step_model, optimizer, scaler, plan, sample, size, steps, meter)
            if trial.status == "fits" and trial.peak_mb is not None and trial.peak_mb > limit:
                trial.status = "over target"
        trials.append(trial)
        peak = "-" if trial.peak_mb is None else f"{trial.peak_mb:.0f}"
        share = "-" if trial.peak_mb is None else f"{trial.peak_mb / limit:.0%}"
        rate = "-" if trial.samples_per_sec is None else f"{trial.samples_per_sec:.1f}"
        note = f" (predicted {trial.peak_mb:.0f} MB)" if trial.status == "skipped" else ""
        say(f"{size:>12} {peak:>9} {share:>9} {rate:>10}  {trial.status}{note}")
        return trial.status == "fits"

    lo = hi = None  # indices into sizes: last that fit, first that did not
    i = 0
    while i is not None:
        if not run(sizes[i]):
            hi = i
            break
        lo = i
        bigger = [j for j, s in enumerate(sizes) if s >= 2 * sizes[i]]
        i = bigger[0] if bigger else (len(sizes) - 1 if i < len(sizes) - 1 else None)
    if lo is not None and hi is not None:
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if run(sizes[mid]) else (lo, mid)
    ooms = [t.batch_size for t in trials if t.status == "out of memory"]
    cap = plan.cfg.system.target_vram * min(ooms) if ooms else float("inf")
    fitted = [t.batch_size for t in trials if t.status == "fits"]
    below = [s for s in sizes if s <= cap and fitted and s <= max(fitted)]
    if below and below[-1] not in [t.batch_size for t in trials]:
        run(below[-1])  # the margin excludes sizes that ran: measure the largest one it allows
    safe = [t.batch_size for t in trials if t.status == "fits" and t.batch_size <= cap]
    return (max(safe) if safe else 0), trials


def choose(trials: list[Trial], largest_safe: int) -> Trial:
    """The fastest safe size; within TIE of it, the smallest (same speed, more headroom)."""
    safe = [t for t in trials if t.status == "fits" and t.batch_size <= largest_safe]
    best = max(t.samples_per_sec for t in safe)
    return min((t for t in safe if t.samples_per_sec >= (1 - TIE) * best), key=lambda t: t.batch_size)


def find(cfg, say, reuse: bool = False, steps: int = TRIAL_STEPS, world: int = 1) -> Result:
    """Build the run's model and data (quietly), then search or reuse; frees what it built."""
    from train.run.plan.build import build

    effective = cfg.optim.effective_batch or cfg.effective_batch_size(world)
    if effective % world:
        raise UsageError(f"EFFECTIVE_BATCH={effective} is not a multiple of the {world} processes")
    per_rank = effective // world
    trial_cfg = copy.deepcopy(cfg)
    trial_cfg.optim.batch_size, trial_cfg.optim.gradient_accumulation_steps = 1, per_rank
    trial_cfg.optim.effective_batch, trial_cfg.optim.lr_scaling = None, "none"
    plan = build(trial_cfg, lambda line: None)
    path = Path(cfg.run.output_dir) / RESULT_FILE
    key = settings_key(plan, effective, world)
    capacity, source = capacity_mb(plan.device, cfg.system.max_memory_mb)
    if capacity is None:
        raise UsageError("MAX_MEMORY_MB: this system does not report its memory; set a budget in MiB")
    limit = cfg.system.target_vram * capacity
    if reuse:
        saved, why = read_saved(path, key, per_rank)
        if saved is not None:
            return Result(saved[0], saved[1], effective, saved[0], limit, capacity, source, source=why)
        say(f"find-batch: {why}; searching")
    unit, objective = unit_of(plan.cfg.run.mode), objective_of(plan)
    say(
        f"find-batch: {plan.model_size} model, MAX_LENGTH {plan.max_length}, {plan.precision} on "
        f"{device_name(plan.device)}, "
        f"{objective}; limit TARGET_VRAM {cfg.system.target_vram:g} x {capacity:.0f} MB ({source}) = "
        f"{limit:.0f} MB; effective batch {effective} {unit} kept"
    )
    # the estimate's answer beside the measured one: what a run without BATCH_SIZE takes
    # (train/run/plan/fill.py)
    estimated, _, _ = estimated_fit(
        plan.cfg,
        plan.model,
        plan.dataset,
        plan.collate,
        plan.max_length,
        plan.precision,
        plan.device.type,
        world,
        plan.family.layout,
        limit * MIB,
        per_rank,
    )
    largest, trials = search(plan, per_rank, limit, capacity, say, steps)
    say(f"find-batch: largest micro-batch under the limit: measured {largest}, estimated {estimated} (the "
        f"memory estimate's, which a run without BATCH_SIZE fills a GPU to)")
    device, fixes = plan.device, remedies(trial_cfg, plan.max_length, plan.precision, hint=False)
    del plan
    free_memory(device)
    if largest == 0:
        first = trials[0]
        need = "runs out of memory" if first.peak_mb is None else f"needs {first.peak_mb:.0f} MB"
        raise UsageError(
            f"find-batch: even BATCH_SIZE=1 {need}, over TARGET_VRAM x {capacity:.0f} MB = {limit:.0f} MB; "
            f"raise MAX_MEMORY_MB or TARGET_VRAM, or try: {fixes}"
        )
    best = choose(trials, largest)
    result = Result(
        best.batch_size,
        per_rank // best.batch_size,
        effective,
        largest,
        limit,
        capacity,
        source,
        best.samples_per_sec,
        best.peak_mb,
        [asdict(t) for t in trials],
        unit=unit,
        objective=objective,
    )
    write(path, key, result)
    return result


def write(path: Path, key: dict, result: Result) -> None:
    from train.core.files import write_json

    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, {**asdict(result), "key": key, "written": time.strftime("%Y-%m-%d %H:%M:%S")})


def find_everywhere(cfg, say, world: Dist = SINGLE, reuse: bool = False, steps: int = TRIAL_STEPS) -> Result:
    """Under torchrun, rank 0 searches (one GPU's answer holds for identical GPUs) and the others
    receive its result, so every rank trains with the same micro-batch. Not yet exercised by a
    test: the DDP launcher lands on another branch."""
    if world.world_size == 1:
        return find(cfg, say, reuse, steps)
    box = [find(cfg, say, reuse, steps, world.world_size) if world.is_main else None]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def auto_batch(cfg, say, world: Dist = SINGLE) -> Chosen:
    """AUTO_BATCH=1: BATCH_SIZE and GRADIENT_ACCUM from find-batch (reusing a saved result for the
    same settings), keeping the effective batch: an input of the run's plan; cfg is left as asked."""
    before = (cfg.optim.batch_size, cfg.optim.gradient_accumulation_steps)
    result = find_everywhere(cfg, say, world, reuse=True)
    gc.collect()
    why = f"was {before[0]} x {before[1]}; effective batch {result.effective_batch} kept; {result.source}"
    say(f"AUTO_BATCH=1: BATCH_SIZE={result.batch_size} GRADIENT_ACCUM={result.gradient_accumulation_steps} "
        f"({why})")
    return Chosen(result.batch_size, result.gradient_accumulation_steps, f"AUTO_BATCH=1: {why}")


def find_batch_main(argv: list[str]) -> int:
    """`python -m train find-batch [pretrain|sft|dpo|grpo] [training flags]`: search, print the variables,
    save them."""
    from train.config.flags import parse_training_args

    if wants_help(
        "find-batch",
        "find the fastest micro-batch that fits TARGET_VRAM, keeping the effective "
        "batch, and save it for AUTO_BATCH=1 (first word pretrain | sft | dpo | grpo: the mode; empty: "
        "pretrain)",
        argv,
    ):
        return 0
    mode, argv = mode_of(argv, "find-batch", (*MODES, "grpo"))
    cfg = parse_training_args(mode, argv)
    result = find_everywhere(cfg, print)
    rate = "" if result.samples_per_sec is None else f", {result.samples_per_sec:.1f} {result.unit}/s"
    print(
        f"largest safe micro-batch {result.largest_safe}; fastest {result.batch_size}{rate}, "
        f"peak {result.peak_mb:.0f} of {result.limit_mb:.0f} MB"
    )
    print(f"BATCH_SIZE={result.batch_size} GRADIENT_ACCUM={result.gradient_accumulation_steps}")
    print(f"saved to {Path(cfg.run.output_dir) / RESULT_FILE}; AUTO_BATCH=1 uses it for these settings")
    return 0
