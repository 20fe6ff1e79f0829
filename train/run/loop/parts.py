"""What the loop holds for one session, built once before the first step: the model as it
trains (DDP-wrapped, FSDP2-sharded or plain; compiled when asked), the optimizer, the GradScaler, the
positioned batch stream (restored by RESUME=1), the out-of-memory guard and the evaluator."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from train.core.optim.registry import build_optimizer
from train.core.step import train_step
from train.data.loader import make_loader
from train.data.stream import BatchStream
from train.distributed import parallel
from train.distributed.process_group import step_total
from train.run.compile import cuda_graphs, wrapper
from train.run.guard.signals import QuietWorkers
from train.run.loop import oom as oom_lib
from train.run.loop.evaluate import Evaluator

if TYPE_CHECKING:
    from train.run.plan.make import Plan


def data_loader(plan: Plan, batch_size: int):
    """(loader, sampler) for this run at a micro-batch, from the one loader factory."""
    w = plan.world
    budget = plan.total_steps * plan.cfg.effective_batch_size(w.world_size)  # samples the whole run trains
    return make_loader(
        plan.dataset,
        plan.cfg.data,
        batch_size,
        plan.cfg.system.seed,
        plan.device,
        plan.collate,
        w.rank,
        w.world_size,
        budget=budget,
    )


@dataclass
class Parts:
    plan: Plan
    model: torch.nn.Module  # what runs the step: wrapped for DDP/FSDP2, compiled when asked
    optimizer: torch.optim.Optimizer
    scaler: object
    gradient_sync: object  # (last micro-step) -> context: gradients stay local until the last
    oom_guard: oom_lib.OomGuard  # the batch stream and the current micro-batch (smaller after an OOM)
    evaluator: Evaluator
    batches: object  # micro-batches: positioned, OOM-aware, compile-aware
    compiled: dict = field(default_factory=dict)

    def set_lr(self, lr: float) -> float:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def train_one_step(self, batches, probed=None, accuracy: bool = False):
        """One optimizer step over `batches` (the meter's counted micro-batches) at the oom_guard's
        micro-batch and accumulation now. On out of memory the oom_guard halves the micro-batch,
        doubles accumulation and redoes the step from its first sample (train/run/loop/oom.py);
        a failed attempt leaves no count (BatchCounter.attempt). probed: the same batches as
        the host-sync counter sees them (its host data), on the one step it counts. accuracy: a
        log step's, which also returns its mean_token_accuracy (train_step)."""
        plan, oom_guard = self.plan, self.oom_guard

        def attempt():
            return batches.attempt(
                lambda: train_step(
                    model=self.model,
                    optimizer=self.optimizer,
                    scaler=self.scaler,
                    batches=probed or batches,
                    accum=oom_guard.accumulation,
                    grad_clip=plan.cfg.optim.grad_clip,
                    device=plan.device,
                    precision=plan.precision,
                    gradient_sync=self.gradient_sync,
                    step_total=step_total(plan.world),
                    accuracy=accuracy,
                    layout=plan.family.layout,
                    objective=plan.objective,
                )
            )

        return oom_guard.step(attempt)


def prepare(plan: Plan, run_dir, say, guard) -> Parts:
    """Build the session's parts; RESUME=1 restores the saved state into them (guard.start)."""
    cfg, device = plan.cfg, plan.device
    # DDP around the model, or the model sharded in place (FSDP2); the optimizer comes after.
    train_model = parallel.wrap(plan.model, plan.world, cfg.system.sharding, cfg.system.offload_optimizer,
                                device)
    optimizer, kind = build_optimizer(cfg.optim, train_model, device)
    say(f"optimizer: {kind}")
    scaler = parallel.build_scaler(plan.precision, train_model, device)

    def open_stream(batch_size: int, epoch: int, start: int) -> BatchStream:
        """A stream of micro-batches of batch_size from a sample position (the start, a resume's,
        or the failed step's after an OOM); workers leave Ctrl+C to the main process."""
        loader, sampler = data_loader(plan, batch_size)
        if loader.num_workers > 0:
            loader.worker_init_fn = QuietWorkers(loader.worker_init_fn)
        return BatchStream(loader, sampler, batch_size, epoch, start)

    # OOM: free, halve the micro-batch, double accumulation, redo the step (train/run/loop/oom.py)
    oom_guard = oom_lib.OomGuard(plan, open_stream, optimizer, scaler, say)
    # Checkpoints, resume, signals: restores the saved state and positions the data
    # (train/run/guard/resume.py).
    guard.start(plan.model, optimizer, scaler, oom_guard)
    batches = oom_guard.batches()
    step_model, compiled = train_model, wrapper.not_compiled()
    if cfg.model.compile and guard.first_step < guard.total_steps:  # RESUME=1 rewriting final/ trains no step
        # batches padded to the length buckets, or DPO's flat row per micro-batch: one graph with dynamic
        # lengths (wrapper.mark_shapes); SFT's packed rows have one length already the collator knows
        # (pretraining's has none)
        # GRPO's rows are the objective's: its scored micro-batches pad to its buckets
        bucketed = any(getattr(x, "length_varies", False) for x in (plan.collate, plan.objective))
        mode = cfg.model.compile_mode or "default"
        step_model, batches, compiled = wrapper.compile_model(
            train_model,
            batches,
            device,
            plan.precision,
            say,
            bucketed,
            plan.family.layout,
            plan.objective,
            mode,
        )
        if compiled["compile"]["enabled"] and mode == cuda_graphs.GRAPHS and device.type == "cuda":
            cuda_graphs.keep_grads(train_model, optimizer)  # accumulation must not add into a replay's buffer
    return Parts(
        plan=plan, model=step_model, optimizer=optimizer, scaler=scaler,
        gradient_sync=parallel.sync_context(train_model), oom_guard=oom_guard,
        evaluator=Evaluator(plan, run_dir, say, plan.val_collate, micro_batch=lambda: oom_guard.batch_size),
        batches=batches, compiled=compiled,
    )
