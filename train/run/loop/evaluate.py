"""Validation: the loss over the held-out set (which the data front doors split off) and the
best model.

A pass runs the model in eval mode under no_grad and the run's autocast, sums the losses on the
device and reads them once (no per-batch .item(), which would stall the device every batch, as
the guides warn).
One path for every mode (validation_pass): the plan's objective weighs, scores and words each batch
(train/core/objective.py), so SFT batches, pairs or a new mode's work unchanged.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.utils.data import Subset

from train.data.holdout import VAL_ROWS
from train.data.loader import make_val_loader
from train.distributed import parallel, process_group
from train.observe.curves import read_metrics

if TYPE_CHECKING:
    from train.run.plan.make import Plan


def evaluate(model, loader, max_batches: int, device: torch.device, precision: str, *, layout):
    """The token loss's pass (validation_pass with TokenObjective): the mean loss per predicted token
    over the first max_batches batches, as one big batch would give it."""
    from train.core.step import TokenObjective

    return validation_pass(model, loader, max_batches, device, precision, TokenObjective(layout))[0]


def validation_pass(model, loader, max_batches: int, device: torch.device, precision: str, objective):
    """(mean loss, the objective's metrics as means) over the first max_batches batches of the loader:
    each batch's mean weighted by what the objective weighs it by (Objective.evaluate: predicted tokens,
    pairs ...), so a short last batch counts by its share. One host read per call. The model is put
    back in the mode it was in."""
    was_training = model.training
    model.eval()
    dtype = torch.float32 if device.type == "mps" else torch.float64  # mps has no float64
    sums, weight = {}, 0
    try:
        with torch.no_grad():
            for index, batch in enumerate(loader):
                if index >= max_batches:
                    break
                share, loss, metrics = objective.evaluate(model, batch, device, precision)
                for name, value in {"loss": loss, **metrics}.items():
                    sums[name] = sums.get(name, 0) + value.to(dtype) * share
                weight += share
    finally:
        model.train(was_training)
    if not weight:
        return None, {}
    totals = torch.stack(list(sums.values())).tolist()  # the one sync of the pass
    means = {name: total / weight for name, total in zip(sums, totals, strict=True)}
    return means.pop("loss"), means


def best_so_far(metrics: Path) -> tuple[float | None, int | None]:
    """The lowest finite val_loss in a resumed run's metrics.jsonl (trimmed to its checkpoint) and its
    step: without it a resumed KEEP_BEST=1 run saved its first pass over best/, however worse."""
    best = step = None
    for row in read_metrics(metrics) if not metrics.is_symlink() else ():
        loss = row.get("val_loss")
        if isinstance(loss, (int, float)) and math.isfinite(loss) and (best is None or loss < best):
            best, step = float(loss), row.get("step")
    return best, step


class Evaluator:
    """Runs the passes a run is due (every EVAL_EVERY steps and at the end), writes the rows,
    keeps the best loss and, with KEEP_BEST=1, the best model in best/."""

    def __init__(self, plan: Plan, run_dir, say, collate_fn=None, micro_batch=None):
        """micro_batch: () -> the training micro-batch now (the OOM guard's; default the plan's)."""
        self.plan, self.run_dir, self.say = plan, run_dir, say
        self.micro_batch = micro_batch or (lambda: plan.cfg.optim.batch_size)
        run = plan.cfg.run
        self.every, self.keep_best = run.eval_every, run.keep_best
        dataset = getattr(plan, "val_dataset", None)
        # EVAL_BATCHES x 8 sequences a pass, in rows of 8 as the held-out set is sized: the same
        # sequences whatever BATCH_SIZE (compare-sft's batch 1 read 20 where batch 16 read 160).
        self.sequences = 0 if dataset is None else min(len(dataset), run.eval_batches * VAL_ROWS)
        if dataset is not None and self.sequences < len(dataset):
            dataset = Subset(dataset, range(self.sequences))
        self.dataset, self.collate_fn = dataset, collate_fn
        batch_size = plan.cfg.optim.batch_size
        self.loader = (None if dataset is None
                       else make_val_loader(dataset, batch_size, plan.device, collate_fn))
        self.batches = -(-self.sequences // batch_size)  # the last one partial
        self.last, self.last_metrics = None, {}
        self.best, self.best_step = best_so_far(Path(run_dir.path) / "metrics.jsonl")  # a fresh run: none
        self.passes, self.seconds = 0, 0.0

    def due(self, step: int, last: bool) -> bool:
        return self.loader is not None and (last or (self.every > 0 and step % self.every == 0))

    def run(self, step: int, samples: int) -> float:
        """One pass; returns the seconds it took, which the loop keeps out of throughput."""
        start = time.perf_counter()
        batch_size = self.micro_batch()
        if self.loader.batch_size != batch_size:  # the micro-batch shrank after an out-of-memory
            self.loader = make_val_loader(self.dataset, batch_size, self.plan.device, self.collate_fn)
            self.batches = -(-self.sequences // batch_size)
        # The eager model: a compiled one would recompile for eval mode and no_grad.
        objective = self.plan.objective
        loss, metrics = validation_pass(
            self.plan.model, self.loader, self.batches, self.plan.device, self.plan.precision, objective
        )
        self.passes += 1
        self.last, self.last_metrics = loss, metrics
        ppl = objective.perplexity(loss)
        self.run_dir.metrics({"step": step, "samples": samples, "val_loss": loss, "val_ppl": ppl,
                              **{f"val_{name}": value for name, value in metrics.items()}})
        if loss is None:
            line = "eval: no tokens"
        else:
            line = f"eval step {step}: val_loss {loss:.4f} {objective.eval_shown(loss, metrics)}"
        improved = loss is not None and math.isfinite(loss) and (self.best is None or loss < self.best)
        if self.keep_best:
            from train.run.guard.health import weights_finite

            improved = improved and weights_finite(self.plan.model)  # a finite loss can hide a NaN weight
            # Saving best/ is collective (a gather, then every rank learns whether rank 0's save
            # worked): ranks whose losses differ in the last bit must still agree it is due.
            improved = bool(process_group.max_across(self.plan.world, [int(improved)])[0])
        if improved:
            self.best, self.best_step = loss, step
            if self.keep_best:
                from train.run.rundir.folder import save_model

                state = parallel.full_state_dict(self.plan.model)  # sharded: a gather every rank joins
                # One writer (the other ranks hold the same weights); a failed save stops every rank.
                process_group.on_main(
                    self.plan.world, lambda: save_model(self.plan, self.run_dir.path / "best", step, state)
                )
                line += " (best so far; saved to best/)"
        self.say(line)
        elapsed = time.perf_counter() - start
        self.seconds += elapsed
        return elapsed

    def summary(self) -> dict:
        return {
            "final_val_loss": self.last,
            "final_val_ppl": self.plan.objective.perplexity(self.last),  # null for a preference loss
            **{
                f"final_val_{name}": value
                for name, value in self.plan.objective.kept(self.last_metrics).items()
            },
            "best_val_loss": self.best,
            "best_val_step": self.best_step,
            "val_sequences": None if self.loader is None else len(self.loader.dataset),
            "eval_passes": self.passes,
            "eval_time_s": self.seconds,
        }


def val_stop(plan: Plan, evaluator: Evaluator, guard, steps_done: int, say) -> str | None:
    """A non-finite validation loss means non-finite weights, whatever the training loss said:
    the same stop as NAN_PATIENCE non-finite training losses (no final/ of those weights)."""
    if plan.cfg.run.nan_patience == 0:
        return None
    loss = evaluator.last
    bad = loss is not None and not math.isfinite(loss)
    if not process_group.max_across(plan.world, [int(bad)])[0]:  # every rank stops at the same step
        return None
    from train.run.checkpoint.on_disk import list_checkpoints

    saved = list_checkpoints(guard.manager.folder)
    if saved:
        then = f"newest good checkpoint: {saved[0].name}; lower LEARNING_RATE and resume with RESUME=1"
    else:
        then = "no checkpoint yet; lower LEARNING_RATE and start again"
    return guard.stop("non_finite_loss", f"validation loss is {loss} at step {steps_done}; {then}")
