"""The training loop. It only trains: each step sets the learning rate, runs one optimizer
step, and hands the rest to the objects that own it: the meter (counts, timing, log lines),
the evaluator (validation passes), the run guard (checkpoints every SAVE_EVERY, Ctrl+C and
SIGTERM, non-finite losses) and the out-of-memory guard (halve the micro-batch, redo the step)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from train.run.loop import oom as oom_lib
from train.run.loop.evaluate import val_stop
from train.run.loop.meter import Meter
from train.run.loop.parts import prepare
from train.run.rundir import report
from train.run.rundir.rundir import stop_for_write

if TYPE_CHECKING:
    from train.run.plan.plan import Plan


def run_loop(plan: Plan, run_dir, say, guard) -> dict:
    """Train from guard.first_step to guard.total_steps (or a stop); returns summary.json's record."""
    parts = prepare(plan, run_dir, say, guard)
    meter = Meter(plan, run_dir, say, guard, parts.batches)
    batches, log_every = meter.batches, plan.cfg.run.log_every
    exit_reason, done, loss_t = "completed", guard.first_step, None
    # the LR curve in samples and the run's counters: the same curve step for step after a resume
    schedule, progress = guard.schedule, guard.progress
    meter.start()
    try:
        for step in range(guard.first_step, guard.total_steps):
            last = step + 1 == guard.total_steps
            log_due = (step + 1) % log_every == 0 or last
            eval_due = parts.evaluator.due(step + 1, last)
            # one quiet steady step runs under the host-sync counter (summary: host_syncs_per_step)
            with meter.sync_probe(step + 1, quiet=not (log_due or eval_due)) as probe:
                lr = parts.set_lr(schedule.lr(progress.samples_at(step)))
                # a log step also counts the targets predicted right (mean_token_accuracy), on the device
                loss_t, norm_t, _, *acc_t = parts.train_one_step(
                    batches, probe.host_batches(batches) if probe else None, accuracy=log_due
                )
                done = step + 1  # only once the step is done: an out-of-memory stop counts it not
                meter.step_end(done, counts_due=log_due or eval_due)
                if log_due:
                    meter.log(done, loss_t, norm_t, lr, acc_t[0])
                    if stop_for_write(plan.world, run_dir):  # a full disk: metrics.jsonl or train.log
                        exit_reason = "write_failed"
                        break
                if eval_due:
                    meter.exclude(parts.evaluator.run(done, meter.samples()))
                # saves every SAVE_EVERY (with the meter's counts); signals; NaN
                stop = guard.step_done(done, loss_t, synced=log_due, counted=meter.counted)
            if not stop and eval_due:
                stop = val_stop(plan, parts.evaluator, guard, done, say)  # a NaN validation loss
            if stop:
                exit_reason = stop
                break
    except oom_lib.OutOfMemoryStop as err:
        exit_reason = "out_of_memory"
        say(f"error: {err}")
    finally:
        guard.close()
        meter.stop()
    meter.last_loss(done, loss_t)  # a stop between log lines: the final loss is the last step's
    if exit_reason == "interrupted":
        say(f"interrupted at step {done}; saving what was trained")
    exit_reason = guard.finish(done, exit_reason, counted=meter.counted)  # non-finite weights: their own stop
    return report.summary(plan, run_dir, meter, parts, guard, done, exit_reason)
