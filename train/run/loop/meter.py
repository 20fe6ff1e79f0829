"""What one session of a run measured: rows, tokens, data wait, steady-state throughput, the
log line and progress bar, and the GPU and host samplers. The loop tells the meter when a step
ended and when a line is due; the meter never changes the run.

Throughput leaves out the first steps (allocator warm-up, worker start-up, compilation: see
steady_start), the validation passes and the checkpoint saves. Counting is on the host (batch
shapes and the collator's ints), and the one device sync is at log points.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import Counter
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from train.core.device import synchronize
from train.core.measure.syncs import HostSyncs
from train.core.measure.timing import INPUT_BOUND_FRAC, StepTimer, exposed_wait_frac
from train.core.objective import Objective
from train.core.step import TokenObjective, compiled_run_eager
from train.core.units import MIB
from train.distributed import process_group
from train.observe import monitor as monitor_lib

if TYPE_CHECKING:
    from train.run.plan.make import Plan

NO_COUNTS = (0, 0, 0)


def steady_start(total_steps: int) -> int:
    """Optimizer steps excluded from throughput: the first ones pay for allocator warm-up,
    worker start-up and compilation."""
    return 0 if total_steps < 2 else min(5, max(1, total_steps // 10))


def format_eta(seconds: float) -> str:
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class BatchCounter:
    """Passes micro-batches through and counts rows, real and padded tokens on the host (shapes
    and the collator's ints: no device sync). Packed pretraining batches are all real tokens.
    An encoder-decoder's tokens are source + target (what tokens_per_sec counts for T5): real
    ones are the source's attention_mask and the labels that are not -100, padded ones both
    tensors' sizes (the layout's batch_tokens). A batch's samples are the objective's to count (rows,
    packed conversations, pairs); default the token loss's."""

    def __init__(self, batches, layout, objective: Objective | None = None):
        self.batches, self.rows, self.real, self.padded = batches, 0, 0, 0
        self.layout, self.objective = layout, objective or TokenObjective(layout)

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        batch = next(self.batches)
        self.rows += self.objective.samples(batch)
        real, padded = self.layout.batch_tokens(batch)
        self.real += int(real)
        self.padded += int(padded)
        return batch

    def counts(self) -> tuple[int, int, int]:
        """(samples, real tokens, padded tokens). An objective whose rollout makes what its steps train on
        (GRPO: prompt + completion, NUM_GENERATIONS rows a prompt) counts those tokens itself (`trained`):
        the loader's batches hold the prompts alone."""
        trained = getattr(self.objective, "trained", None)
        return (self.rows, *trained) if trained is not None else (self.rows, self.real, self.padded)

    def attempt(self, fn):
        """fn() (one optimizer step); a failed attempt (an OOM, redone smaller) leaves no count."""
        mark = self.counts()
        try:
            return fn()
        except BaseException:
            self.rows, self.real, self.padded = mark
            if getattr(self.objective, "trained", None) is not None:
                self.objective.trained[:] = mark[1:]
            raise


class Meter:
    """Counts, times and logs one session of a run (see the module doc)."""

    def __init__(self, plan: Plan, run_dir, say, guard, batches):
        self.plan, self.run_dir, self.say, self.guard = plan, run_dir, say, guard
        self.device, self.world = plan.device, plan.world
        self.timer = StepTimer(plan.device)  # data wait vs compute; CUDA events, read only at log points
        self.objective = plan.objective  # the mode's: what a batch's samples are, the log line's fields
        self.batches = BatchCounter(self.timer.wrap(batches), plan.family.layout, plan.objective)
        self.first = guard.first_step
        self.base = guard.samples_at(self.first)  # samples trained before this session
        self.skip = steady_start(guard.total_steps)
        self.seen = self.steady_at = self.interval_at = NO_COUNTS  # after whole steps, all ranks
        # the last logged loss (after the loop: the last step's, see last_loss)
        self.loss: float | None = None
        self.loss_step: int | None = None  # the step self.loss is of
        self.last_metrics: dict = {}  # and the last logged metrics (the objective's: token accuracy ...)
        self.first_step_s = None
        self.excluded = 0.0  # seconds of validation passes so far (kept out of the ETA)
        self.gpu = monitor_lib.GpuMonitor((self.device.index or 0) if self.device.type == "cuda" else None)
        self.host = monitor_lib.HostMemoryPeaks()
        self.host_syncs: list[str] | None = None  # the probed step's syncs, each with its line
        # an objective's rollout (GRPO's sampling)
        self.rollout_at = self.interval_rollout = self._rollout_s()

    def _rollout_s(self) -> float | None:
        """Seconds the objective's rollout took so far (its generation, inside the steps), or None."""
        seconds = getattr(self.objective, "rollout_seconds", None)
        return None if seconds is None else float(seconds)

    def counted(self) -> tuple[int, int]:
        """(samples, tokens) trained so far, all ranks (a collective), for a checkpoint."""
        return self.totals(process_group.sum_across(self.world, self.batches.counts()))

    def start(self) -> None:
        self.gpu.start()
        if self.gpu.note:
            self.say(self.gpu.note)  # once per run: why avg_gpu_util and the VRAM total are null
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.t0 = self.steady_t0 = self.interval_t0 = time.perf_counter()
        if self.skip == 0:
            self.timer.start_steady()
        # disable=None: a live bar on a terminal; in a log file the progress lines are printed instead
        self.bar = tqdm(
            total=self.guard.total_steps, initial=self.first, desc=self.plan.cfg.run.mode, unit="step",
            dynamic_ncols=True, disable=None if self.world.is_main else True,
        )

    def totals(self, counts) -> tuple[int, int]:
        """(samples, tokens) since the run began, earlier sessions included (as counted where
        the checkpoint has the counts; older checkpoints: steps x effective batch)."""
        before = self.guard.counted_before
        if before is not None:
            return before[0] + counts[0], before[1] + counts[1]
        per_row = counts[1] / counts[0] if counts[0] else self.plan.max_length
        return self.base + counts[0], round(self.base * per_row) + counts[1]

    def step_end(self, done: int, counts_due: bool) -> None:
        """After optimizer step `done`: all ranks' counts where a figure needs them (the same
        steps on every rank), the first step's time, and the start of the steady state."""
        self.timer.step_end()
        warmed = done - self.first == self.skip
        if counts_due or warmed or self.first_step_s is None:
            self.seen = process_group.sum_across(self.world, self.batches.counts())
        if warmed or self.first_step_s is None:
            synchronize(self.device)
            now = time.perf_counter()
            if self.first_step_s is None:
                self.first_step_s = now - self.t0
            if warmed:
                self.steady_t0, self.steady_at = now, self.seen
                self.rollout_at = self._rollout_s()
                self.timer.start_steady()
                self._eta_line(done, now)
        self.bar.update(1)

    def _eta_line(self, done: int, now: float) -> None:
        """Once, after the warm-up steps: what this machine measured, not the README's quiet-core
        figures (a shared 2-core machine ran 4 to 12 times slower than they say)."""
        per_step = (now - self.t0 - self.excluded) / max(1, done - self.first)
        left = self.guard.total_steps - done
        if left > 0:
            self.say(f"about {per_step:.2f} s per step on this machine (the first {done - self.first} "
                     f"steps), {left} steps to go: ETA {format_eta(per_step * left)}")  # fmt: skip

    @contextlib.contextmanager
    def sync_probe(self, done: int, quiet: bool):
        """Yields a HostSyncs counter over the first quiet step from the second on (no log line,
        validation or save due; the first step builds the optimizer state once), else None. Its
        ops pay a Python call each (tens of ms once), so it is a warm-up step where the run has
        two or more (steady_start: from 20 steps), outside the throughput figures."""
        save_every = self.plan.cfg.run.save_every
        quiet = quiet and not (save_every > 0 and done % save_every == 0)
        if self.host_syncs is not None or not quiet or done - self.first < 2:
            yield None
            return
        # Eager for this one step under COMPILE=1: a dispatch mode inside compiled frames made
        # dynamo skip them for good (every later step eager, silently). force_eager leaves the
        # compiled code and its caches as they are; the step's own syncs are the same eager, and
        # compiled_run_eager leaves out the one look the compile traces away.
        with compiled_run_eager(), HostSyncs(self.device) as counter:
            yield counter
        self.host_syncs = [f"{n} x {s}" for s, n in Counter(counter.syncs).items()]
        self.host_syncs_count = counter.count

    def log(self, step: int, loss_t, norm_t, lr: float, accuracy_t) -> None:
        """One metrics row and console line: the one host sync of the interval (loss, grad norm
        and mean_token_accuracy read together). The accuracy share of each rank adds up to the
        token mean over all ranks' targets, as the loss does: averaged across ranks with it.
        accuracy_t: train_step's fourth value, the objective's metrics (the token accuracy; preference
        training: TRL's rewards/... and logps/..., each the step's mean over pairs, the same way)."""
        wait_s, compute_s = self.timer.take_interval()
        named = self.objective.named(accuracy_t)
        stacked = torch.stack([loss_t.float(), *(v.float() for v in named.values())])
        means, wait_s = process_group.mean_across(self.world, stacked, wait_s)
        loss, *values, grad_norm = torch.cat([means, norm_t.float().reshape(1)]).tolist()
        self.loss, self.loss_step, self.last_metrics = loss, step, dict(zip(named, values, strict=True))
        now = time.perf_counter()
        span = now - self.interval_t0
        samples, tokens = self.totals(self.seen)
        row = {
            "step": step, "samples": samples, "tokens": tokens, "loss": loss, "lr": lr,
            "grad_norm": grad_norm, **self.last_metrics,
            "samples_per_sec": (self.seen[0] - self.interval_at[0]) / span,
            "data_wait_frac": exposed_wait_frac(wait_s, compute_s, span),
            "compute_frac": min(1.0, compute_s / span) if span > 0 else None,
            "elapsed_s": now - self.t0,
        }
        rollout = self._rollout_s()
        if rollout is not None:  # the share of the interval spent making the step's completions
            row["generation_frac"] = min(1.0, (rollout - self.interval_rollout) / span) if span > 0 else None
            self.interval_rollout = rollout
        self.run_dir.metrics(row)
        self._show(step, row, now)
        warning = self.host.sample()
        if warning:
            self.say(warning)
        if not math.isfinite(loss):
            self.say(f"warning: loss is {loss} at step {step}")
        self.interval_t0, self.interval_at = now, self.seen

    def _show(self, step: int, row: dict, now: float) -> None:
        postfix = {"loss": f"{row['loss']:.3f}", "samples/s": f"{row['samples_per_sec']:.1f}"}
        if self.device.type == "cuda":
            postfix["VRAM"] = f"{torch.cuda.max_memory_allocated(self.device) / MIB:.0f}MB"
        self.bar.set_postfix(postfix)
        total, wait = self.guard.total_steps, row["data_wait_frac"] or 0
        train_s = now - self.t0 - self.excluded
        eta = train_s / (step - self.first) * (total - step)
        line = (
            f"step {step}/{total} loss {row['loss']:.4f} {self.objective.shown(row)} lr {row['lr']:.2e} "
            f"samples/s {row['samples_per_sec']:.1f} data-wait {wait:.0%} "
            + (f"generation {row['generation_frac']:.0%} " if row.get("generation_frac") is not None else "")
            + f"ETA {format_eta(eta)}" + (" (input-bound)" if wait > INPUT_BOUND_FRAC else "")
        )
        if self.bar.disable:
            self.say(line)
        else:
            self.run_dir.log(line)

    def last_loss(self, step: int, loss_t) -> None:
        """After the loop: a run that stopped between log lines (Ctrl+C, SIGTERM) reports the loss of
        the last step it ran, not of the last logged one (summary.json's final_loss, the "done:" line).
        One read, all ranks' mean as a log line's; every rank calls it (a collective)."""
        if loss_t is None or step == self.loss_step:
            return
        mean, _ = process_group.mean_across(self.world, loss_t.detach().float().reshape(1), 0.0)
        self.loss, self.loss_step = float(mean[0]), step

    def exclude(self, seconds: float) -> None:
        """A validation pass took `seconds`: throughput counts training only."""
        self.excluded += seconds
        self.steady_t0, self.interval_t0 = self.steady_t0 + seconds, self.interval_t0 + seconds

    def samples(self) -> int:
        return self.totals(self.seen)[0]

    def stop(self) -> None:
        """The end of the timed loop (before the final save): stop the samplers, sum the counts."""
        self.bar.close()
        synchronize(self.device)
        self.gpu_summary = self.gpu.stop()
        self.steady_split = self.timer.steady_totals()
        self.end = time.perf_counter()
        self.seen = process_group.sum_across(self.world, self.batches.counts())

    def figures(self, done: int) -> dict:
        """Throughput, step time and data wait of the steady state, on real tokens and rows
        counted as they passed (SFT batches vary in both)."""
        run_steps = done - self.first  # this session's steps (a resumed run started at `first`)
        steady_steps = max(0, run_steps - self.skip)
        began = self.steady_t0 if steady_steps else self.t0
        steady_s = self.end - began - self.guard.seconds_saving_since(self.steady_t0, self.end)
        steady_steps = steady_steps or run_steps
        start_at = self.steady_at if run_steps > self.skip else NO_COUNTS
        rows, real = self.seen[0] - start_at[0], self.seen[1] - start_at[1]
        samples_per_sec = rows / steady_s if steady_s > 0 and run_steps else None
        split = self.steady_split if self.steady_split and run_steps > self.skip else (None, None)
        wait_s, compute_s = split
        data_wait = exposed_wait_frac(wait_s, compute_s, steady_s) if wait_s is not None else None
        samples, tokens = self.totals(self.seen)
        return {
            "samples": samples,
            "tokens": tokens,
            "padding_efficiency": self.seen[1] / self.seen[2] if self.seen[2] else None,
            "wall_time_s": self.end - self.t0,
            "time_to_first_step_s": self.first_step_s,
            "steady_state_steps": steady_steps,
            "samples_per_sec": samples_per_sec,
            "tokens_per_sec": real / steady_s if samples_per_sec else None,
            "step_time_ms": 1000 * steady_s / steady_steps if steady_steps else None,
            "data_wait_frac": data_wait,
            "data_wait_s": wait_s,
            "compute_s": compute_s,
            "compute_frac": min(1.0, compute_s / steady_s)
            if compute_s is not None and steady_s > 0
            else None,
            "input_bound": data_wait is not None and data_wait > INPUT_BOUND_FRAC,
            # syncs of one quiet steady optimizer step (None: the run had no such step)
            "host_syncs_per_step": None if self.host_syncs is None else self.host_syncs_count,
            "host_syncs": self.host_syncs,
            **self._generation(steady_s, run_steps),
        }

    def _generation(self, steady_s: float, run_steps: int) -> dict:
        """generation_s and generation_frac of the steady state, where the objective has a rollout."""
        rollout = self._rollout_s()
        if rollout is None:
            return {}
        seconds = rollout - (self.rollout_at if run_steps > self.skip else 0.0)
        return {
            "generation_s": seconds,
            "generation_frac": min(1.0, seconds / steady_s) if steady_s > 0 else None,
        }
