"""Never lose a run: periodic checkpoints, exact resume, Ctrl+C / SIGTERM, non-finite losses.

The loop calls a RunGuard at start (restore the state, position the data), after every
optimizer step (count skipped and non-finite steps on the device, save every SAVE_EVERY steps,
stop on a signal or NAN_PATIENCE) and at the end (save). Exact resume restores the weights,
optimizer, GradScaler, every RNG, the step and sample counters and the data position (epoch and
samples consumed in it), so a continued run repeats the uninterrupted one step for step.

The LR schedule is a function of samples consumed, not of steps: with the same settings that is
the same curve step for step; with a changed BATCH_SIZE or GRADIENT_ACCUM the run continues at
the same sample, at the same point of the warm-up and cosine, and ends at the same sample.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from pathlib import Path

import torch

from config import env_name
from train.core import files
from train.core.errors import UsageError
from train.data.stream import BatchStream
from train.dist import distributed, parallel
from train.run.checkpoint import (
    SHARDS,
    CheckpointManager,
    checkpoint_name,
    list_checkpoints,
)
from train.run.health import Health
from train.run.rng import rng_state, set_rng_state
from train.run.signals import QuietWorkers, StopSignals

# Settings compared with the checkpoint's on resume, to say what changed.
COMPARED = (
    "batch_size gradient_accumulation_steps precision learning_rate min_lr_ratio max_steps epochs "
    "max_samples warmup_steps num_workers"
).split()
BUDGET = ("max_steps", "epochs", "max_samples")


def trim_metrics(path: Path, step: int) -> int:
    """Drop metrics rows after `step` (written after the checkpoint, by the run that died), so
    metrics.jsonl stays one clean record. Returns how many were dropped."""
    if not os.path.lexists(path):
        return 0
    kept, dropped = [], 0
    for line in files.read_text(path).splitlines():  # a link there is refused, never read
        try:
            row_step = json.loads(line).get("step", 0)
        except (ValueError, AttributeError):
            dropped += 1  # half a line from a kill mid-write
            continue
        if row_step <= step:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        files.atomic_write(path, "".join(line + "\n" for line in kept))
    return dropped


class RunGuard:
    """Checkpoints, resume, signals and non-finite losses for one run (see the module doc)."""

    def __init__(self, b, run_path: Path, say, param_groups):
        """Fresh run: plan the schedule. RESUME=1: find the newest valid checkpoint (weights
        go into b.model), re-plan the remaining steps, and only then touch the run folder."""
        self.b, self.cfg, self.say, self.run_path = b, b.cfg, say, Path(run_path)
        r = self.cfg.run
        self.effective = self.cfg.effective_batch_size(b.world.world_size)
        # Rank 0 of a DDP run saves for all (every rank holds the same weights); with SHARDING
        # every rank writes its own shards (train/run/checkpoint.py).
        self.sharding = self.cfg.system.sharding
        self.saves = b.world.is_main or self.sharding != "none"
        self.manager = CheckpointManager(self.run_path / "checkpoints", r.keep_checkpoints, say)
        self.signals = StopSignals(announce=b.world.is_main)
        self.stop_signal: int | None = None
        # () -> (samples, tokens) trained so far, all ranks, set by the loop; a collective
        self.counted = None
        self.counted_before: tuple[int, int] | None = None  # the same at the checkpoint resumed
        self.loaded = None
        self.first_step = self.base_samples = self.epoch = self.consumed = 0
        self.unit = self.effective
        self.warmup_samples = b.warmup_steps * self.effective
        self.budget_samples = b.total_steps * self.effective
        self.counters = {"skipped_steps": 0, "non_finite_steps": 0}
        self.saving_s: list[tuple[float, float]] = []
        self.stop_detail = ""
        self.resuming = r.resume
        self.complete = False  # RESUME=1 of a run that has nothing left to train
        if r.resume:
            self._resume(param_groups())

    # ---- resume ---------------------------------------------------------------------------

    def _resume(self, param_groups) -> None:
        loaded, rejected = self.manager.newest_valid(self.b.model, param_groups, self.sharding, self._settings())
        if loaded is None:
            reasons = "; ".join(f"{p.name}: {why}" for p, why in rejected) or "none saved"
            raise UsageError(f"RESUME=1: no usable checkpoint in {self.manager.folder} ({reasons})")
        names = distributed.gather(loaded.path.name)
        if len(set(names)) > 1:  # a checkpoint folder not shared by every machine
            raise UsageError(f"RESUME=1: the processes found different newest checkpoints ({', '.join(names)})")
        self.loaded, meta = loaded, loaded.meta
        self._take_counts(meta)
        say, saved = self.say, meta["settings"]
        samples = self.counted_before[0] if self.counted_before else meta["samples"]
        say(
            f"resuming {self.run_path} from checkpoint {loaded.path.name}: step {meta['step']}, "
            f"{samples:,} samples, epoch {meta['data']['epoch']} position {meta['data']['position']:,}"
        )
        self._compare_settings(saved)
        self._position_data(meta["data"])
        remaining = max(0, math.ceil((self.budget_samples - self.base_samples) / self.effective))
        if remaining == 0 and self._finished(loaded.path.name):
            return
        self._replan(remaining, saved)
        # Everything checked: now the run folder may change (rank 0 alone, once every rank has
        # read its checkpoint).
        distributed.agree(None)
        if not self.b.world.is_main:
            return
        self.manager.set_aside(rejected)
        self.manager.clean_temporary()
        dropped = trim_metrics(self.run_path / "metrics.jsonl", self.first_step)
        if dropped:
            say(f"dropped {dropped} metrics row(s) written after step {self.first_step} by the stopped run")

    def _take_counts(self, meta: dict) -> None:
        """Step, samples, counted rows and tokens, counters and the schedule, as saved."""
        self.first_step, self.base_samples = meta["step"], meta["samples"]
        counted = meta.get("counted")
        if isinstance(counted, dict) and all(isinstance(counted.get(k), int) for k in ("samples", "tokens")):
            self.counted_before = (counted["samples"], counted["tokens"])
        self.counters.update(meta.get("counters", {}))
        sched = meta["schedule"]
        self.unit, self.warmup_samples, self.budget_samples = (
            sched["unit_samples"],
            sched["warmup_samples"],
            sched["budget_samples"],
        )

    def _compare_settings(self, saved: dict) -> None:
        """Say what changed since the checkpoint; a changed length or warm-up re-plans them."""
        now = self._settings()
        changed = [f"{env_name(k)} {saved.get(k)} -> {now[k]}" for k in COMPARED if saved.get(k) != now[k]]
        if changed:
            self.say("changed since the checkpoint: " + ", ".join(changed))
        if any(saved.get(k) != now[k] for k in BUDGET):
            self.budget_samples = self.b.total_steps * self.effective
            self.say(f"the run's length changed: the schedule now ends at {self.budget_samples:,} samples")
        if saved.get("warmup_steps") != now["warmup_steps"]:
            self.warmup_samples = self.b.warmup_steps * self.effective

    def _position_data(self, data: dict) -> None:
        """The saved data position, where the data is the same; else the start of a new epoch."""
        saved_world, world = data.get("world_size", 1), self.b.world.world_size
        if data["identity"] == self._data_identity():
            self.epoch, self.consumed = data["epoch"], data["position"]
            if saved_world != world:
                self.say(
                    f"{saved_world} process(es) saved this checkpoint, {world} continue it: the data position "
                    f"carries over (each takes its share of the epoch from sample {self.consumed:,})"
                )
        else:
            self.epoch, self.consumed = data["epoch"] + 1, 0
            self.say(
                "the data changed since the checkpoint (sequences, MAX_LENGTH, SEED or DATA_PATH): its position "
                "cannot carry over, so the new data is read from the start of a new epoch"
            )

    def _finished(self, name: str) -> bool:
        """Nothing left to train. Complete (True) only with its summary.json and a whole final/ of
        this step (a full disk may have stopped it writing them): then nothing of the run folder
        is touched. Else the session writes them. Rank 0 reads, every rank agrees."""
        from train.run.rundir import unfinished

        missing = distributed.on_main(self.b.world, lambda: unfinished(self.run_path, self.first_step))
        if missing is None:  # a finished run (a scheduler's requeue, a repeated command)
            self.complete = True
            self.say(
                f"{self.run_path} is complete: its checkpoint {name} is at {self.base_samples:,} of "
                f"the schedule's {self.budget_samples:,} samples; nothing to do (raise MAX_STEPS, EPOCHS or "
                "MAX_SAMPLES to train it further)"
            )
            return True
        self.say(
            f"{self.run_path} is trained to the end but {missing}: writing final/ and summary.json from "
            f"checkpoint {name}"
        )
        return False

    def _replan(self, remaining: int, saved: dict) -> None:
        """The steps left, as a decision with its reason."""
        planned = self.b.total_steps
        self.b.total_steps = self.first_step + remaining
        self.b.warmup_steps = math.ceil(self.warmup_samples / self.effective)
        progress = min(1.0, self.base_samples / max(1, self.budget_samples))
        why = (
            f"resumed at step {self.first_step} ({progress:.0%} of the schedule's {self.budget_samples:,} samples); "
            f"{remaining} steps of {self.effective} sequences remain"
        )
        if saved.get("effective_batch_size") != self.effective:
            why += (
                f"; effective batch {saved.get('effective_batch_size')} -> {self.effective}: same sample position, "
                f"the LR schedule keeps its progress in samples (steps continue from {self.first_step})"
            )
        if planned != self.b.total_steps:
            why += f"; a new run with these settings would plan {planned} steps"
        self.b.decisions.append({"setting": "total_steps", "value": self.b.total_steps, "reason": why})
        self.say(f"  total_steps = {self.b.total_steps}  ({why})")

    def _settings(self) -> dict:
        o = self.cfg.optim
        settings = {k: getattr(o, k) for k in COMPARED if hasattr(o, k)}
        settings.update(precision=self.b.precision, num_workers=self.cfg.data.num_workers)
        settings.update(
            effective_batch_size=self.effective, model_size=self.b.model_size, max_length=self.b.max_length
        )
        # what chose the model, for the changed-model message of a later RESUME=1
        settings.update(model_config=self.cfg.model.model_config, model_path=self.b.summary_extra.get("model_path"))
        return settings

    def _data_identity(self) -> dict:
        source = getattr(self.b.dataset, "_source", None)
        return {
            "sequences": len(self.b.dataset),
            "max_length": self.b.max_length,
            "seed": self.cfg.system.seed,
            "source": Path(str(source[0])).name if source else type(self.b.dataset).__name__,
        }

    # ---- the loop's calls -----------------------------------------------------------------

    def start(self, model, optimizer, scaler, loader, sampler) -> BatchStream:
        """Apply the loaded state and return the positioned batch stream (RNG restored last)."""
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        if self.loaded is not None and self.sharding != "none":
            parallel.load_sharded(self.loaded.path / SHARDS, model, optimizer)
        elif self.loaded is not None:
            optimizer.load_state_dict(self.loaded.optimizer)
            if scaler.is_enabled() and self.loaded.scaler:
                scaler.load_state_dict(self.loaded.scaler)
        if loader.num_workers > 0:
            loader.worker_init_fn = QuietWorkers(loader.worker_init_fn)
        stream = BatchStream(loader, sampler, self.cfg.optim.batch_size, self.epoch, self.consumed)
        if self.loaded is not None:
            ranks, world = self.loaded.rng_ranks, self.b.world
            # each rank its own states; with another number of processes, rank 0's for all
            set_rng_state(ranks[world.rank] if ranks and len(ranks) == world.world_size else self.loaded.rng)
            self.loaded = None  # free the host copies of the optimizer state
        self.stream = stream
        self.health = Health(scaler, self.counters)
        self.signals.install()
        return stream

    def samples_at(self, steps_done: int) -> int:
        return self.base_samples + (steps_done - self.first_step) * self.effective

    def schedule_at(self, step: int) -> tuple[float, float, float]:
        """(position, warm-up, length) for lr_at, in steps of the run's first effective batch.
        With unchanged settings these are exactly (step, WARMUP_STEPS, total steps)."""
        return (
            self.samples_at(step) / self.unit,
            self.warmup_samples / self.unit,
            self.budget_samples / self.unit,
        )

    def step_done(self, steps_done: int, loss: torch.Tensor, synced: bool) -> str | None:
        """After each optimizer step. Counts on the device (no host sync); reads the counts only
        where the loop already synced (a log line) or is about to save. Returns a stop reason."""
        self.health.step(loss)
        r = self.cfg.run
        save_due = r.save_every > 0 and steps_done % r.save_every == 0 and steps_done < self.b.total_steps
        streak = self.health.streak_now() if (synced or save_due) and r.nan_patience > 0 else 0
        # Every rank stops at the same step, or one waits forever in a collective: a signal seen
        # by any rank (torchrun forwards one to each, at different moments) and the longest
        # non-finite streak are shared, one small all-reduce per step on the host.
        signum, streak = distributed.max_across(self.b.world, [self.signals.received or 0, streak])
        if signum:
            self.stop_signal = signum
            return "interrupted"
        if streak >= r.nan_patience > 0:
            first_bad = steps_done - streak + 1
            last = self.manager.last_saved or (list_checkpoints(self.manager.folder) or [None])[0]
            last = getattr(last, "name", last)
            self.stop_detail = (
                f"loss non-finite for {streak} steps in a row from step {first_bad} (NAN_PATIENCE={r.nan_patience}); "
                f"newest good checkpoint: {last or 'none'}; lower LEARNING_RATE and resume with RESUME=1"
            )
            self.say("stopping: " + self.stop_detail)
            return "non_finite_loss"
        if save_due:
            self.save(steps_done)
        return None

    def save(self, steps_done: int) -> None:
        """Save unless the model is unhealthy (a non-finite loss at this step or non-finite
        weights on any rank): a checkpoint must be one worth resuming from. Every rank calls
        it at the same step (the RNG states and counts are gathered); rank 0 writes, or with
        SHARDING every rank writes its shards."""
        start = time.perf_counter()
        healthy = self.health.worth_saving(self.model)
        if distributed.max_across(self.b.world, [int(not healthy)])[0]:
            self.say(f"not saving at step {steps_done}: the loss or weights are non-finite")
            return
        rngs = distributed.gather(rng_state())
        counted = self.counted() if self.counted else None
        if not self.saves:
            self.manager.last_saved = checkpoint_name(steps_done)  # as rank 0 will have it
            return
        self.health.read()
        meta = self._meta(steps_done, counted)
        if self.sharding != "none":
            self.manager.save_sharded(
                steps_done, self.model, self.optimizer, self.scaler, meta, self.b.world, rngs
            )
        else:
            self.manager.save(steps_done, self.model, self.optimizer, self.scaler, meta, rngs)
        self.saving_s.append((start, time.perf_counter() - start))
        self.say(f"saved checkpoint {self.manager.last_saved} ({time.perf_counter() - start:.1f} s)")

    def seconds_saving_since(self, t0: float, t1: float = float("inf")) -> float:
        """Time spent saving inside the loop between t0 and t1 (left out of the throughput
        figures); the save at the end, after the loop's clock stopped, is not inside."""
        return sum(span for start, span in self.saving_s if t0 <= start < t1)

    def close(self) -> None:
        self.signals.restore()
        stream = getattr(self, "stream", None)
        if stream is not None:
            stream.close()

    def finish(self, steps_done: int, exit_reason: str) -> None:
        """The checkpoint at the end (and after a stop signal), unless the run stopped on
        non-finite losses: then the newest checkpoint is the good one from before them."""
        self.close()
        trained = self.health.trained
        if (
            exit_reason in ("completed", "interrupted", "out_of_memory")
            and trained
            and self.manager.last_saved != checkpoint_name(steps_done)
        ):
            self.save(steps_done)
        self.health.read()

    # ---- state ----------------------------------------------------------------------------

    def _meta(self, steps_done: int, counted: tuple[int, int] | None) -> dict:
        samples = self.samples_at(steps_done)  # in the schedule's units: steps x effective batch
        return {
            "samples": samples,
            "tokens": samples * self.b.max_length,
            # rows and real tokens as counted (SFT batches vary in both), for the figures
            "counted": {"samples": counted[0], "tokens": counted[1]} if counted else None,
            "data": {
                "epoch": self.stream.epoch,
                "position": self.stream.consumed,  # global: samples of the epoch all ranks consumed
                "world_size": self.b.world.world_size,
                "identity": self._data_identity(),
            },
            "sharding": self.sharding,
            "schedule": {
                "unit_samples": self.unit,
                "warmup_samples": self.warmup_samples,
                "budget_samples": self.budget_samples,
            },
            "settings": self._settings(),
            "counters": dict(self.counters),
        }

    def summary(self) -> dict:
        scale = self.scaler.get_scale() if self.scaler.is_enabled() else None
        return {
            "resumed_from_step": self.first_step if self.resuming else None,
            "checkpoint": self.manager.last_saved,
            "skipped_steps": self.counters["skipped_steps"],
            "non_finite_steps": self.counters["non_finite_steps"],
            "loss_scale": scale,
            "stop_signal": signal.Signals(self.stop_signal).name if self.stop_signal else None,
            "stop_detail": self.stop_detail or None,
        }

    def exit_code(self, exit_reason: str) -> int:
        """0 completed; 128 + the signal number when stopped by one (130 Ctrl+C, 143 SIGTERM),
        as shells report it; 1 when non-finite losses or repeated out-of-memory stopped the run."""
        if exit_reason == "interrupted":
            return 128 + (self.stop_signal or signal.SIGINT)
        return 1 if exit_reason in ("non_finite_loss", "out_of_memory") else 0
