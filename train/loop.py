"""The training loop: one function per concern (optimizer, schedule, step, run)."""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict

import torch
from tqdm import tqdm

from config import TrainConfig
from train import compile_guard, distributed
from train import monitor as monitor_lib
from train import oom as oom_lib
from train.build import Built, build
from train.curves import plot_curves
from train.device import autocast, device_name, synchronize
from train.estimate import MIB, estimate_for_run
from train.evaluate import Evaluator
from train.mfu import flops_per_token, mfu_report
from train.model import count_params, shape
from train.outputs import earlier_summary, finish, report
from train.resume import BatchStream, RunGuard
from train.rundir import RunDir, claim_run_dir
from train.runlog import capture_warnings
from train.timing import INPUT_BOUND_FRAC, StepTimer, exposed_wait_frac


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device):
    """AdamW with decay on matrices only; fused (one kernel for all parameters) where the
    device has it, which saves the per-parameter launch overhead of the for-loop version.
    On CPU too (bench/RESULTS.md): nano's step takes 4.9 ms fused vs 18.3 foreach, 17.2 for-loop."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.optim.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    betas = (0.9, 0.95)
    try:
        return torch.optim.AdamW(groups, lr=cfg.optim.learning_rate, betas=betas, fused=True), "fused"
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(groups, lr=cfg.optim.learning_rate, betas=betas, foreach=True), "foreach"


def lr_at(step: int, peak: float, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up to the peak, then cosine decay to peak x min_ratio (step counts from 0)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def batch_stream(loader, sampler, epoch: int = 0):
    """Micro-batches forever, epoch after epoch (each epoch its own seeded shuffle)."""
    while True:
        sampler.set_position(epoch)
        yield from loader
        epoch += 1


def forward_loss(model, batch: dict, device: torch.device, precision: str) -> torch.Tensor:
    # Only tensors reach the model: SFT's PadCollator also hands over the ints n_real_tokens and
    # n_padded_tokens, which BatchCounter has already read on the host. With padded SFT batches
    # transformers' loss is the mean over this micro-batch's trained tokens (labels != -100), so
    # with accumulation each micro-batch weighs the same whatever its token count, as in the
    # transformers Trainer for years; acceptable, and the same rule for every run compared.
    batch = {k: v.to(device, non_blocking=True) for k, v in batch.items() if torch.is_tensor(v)}
    labels = batch.pop("labels", batch["input_ids"])
    with autocast(device, precision):
        return model(**batch, labels=labels).loss


def train_step(model, optimizer, scaler, batches, accum: int, grad_clip: float, device, precision, gradient_sync=None):
    """One optimizer step: micro-steps (autocast, backward of loss/accum) -> unscale -> clip
    -> step -> zero_grad. Returns (mean loss, grad norm) as device tensors, so nothing here
    waits for the device, and the seconds spent waiting for batches. gradient_sync(last) (from
    train.distributed) keeps gradients local on all but the last micro-step."""
    loss_sum = torch.zeros((), device=device)
    waited = 0.0
    for micro in range(accum):
        start = time.perf_counter()
        batch = next(batches)
        waited += time.perf_counter() - start
        with gradient_sync(micro + 1 == accum) if gradient_sync else contextlib.nullcontext():
            loss = forward_loss(model, batch, device, precision)
            scaler.scale(loss / accum).backward()
        loss_sum += loss.detach()
    scaler.unscale_(optimizer)
    if grad_clip > 0:
        grad_norm = distributed.full_value(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip))
    else:
        grad_norm = torch.zeros((), device=device)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum / accum, grad_norm, waited


class BatchCounter:
    """Passes micro-batches through and counts rows, real and padded tokens on the host (shapes
    and the collator's ints: no device sync). Packed pretraining batches are all real tokens."""

    def __init__(self, batches):
        self.batches, self.rows, self.real, self.padded = batches, 0, 0, 0

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        batch = next(self.batches)
        ids = batch["input_ids"]
        self.rows += ids.shape[0]
        self.real += int(batch.get("n_real_tokens", ids.numel()))
        self.padded += int(batch.get("n_padded_tokens", ids.numel()))
        return batch

    def counts(self) -> tuple[int, int, int]:
        return self.rows, self.real, self.padded


class Console:
    """Console lines (through tqdm so the bar stays intact), copied into train.log."""

    def __init__(self):
        self.pending, self.run_dir = [], None

    def __call__(self, line: str) -> None:
        tqdm.write(line)
        if self.run_dir is None:
            self.pending.append(line)
        else:
            self.run_dir.log(line)

    def attach(self, run_dir: RunDir) -> None:
        self.run_dir = run_dir
        for line in self.pending:
            run_dir.log(line)
        self.pending = []


def steady_start(total_steps: int) -> int:
    """Optimizer steps excluded from throughput: the first ones pay for allocator warm-up,
    worker start-up and compilation."""
    return 0 if total_steps < 2 else min(5, max(1, total_steps // 10))


def run_loop(b: Built, run_dir: RunDir, say, guard: RunGuard | None = None) -> dict:
    cfg, device, model = b.cfg, b.device, b.model
    o = cfg.optim
    # DDP around the model, or the model sharded in place (FSDP2); the optimizer comes after.
    train_model = distributed.wrap(model, b.world, cfg.system.sharding, cfg.system.offload_optimizer, device)
    gradient_sync = distributed.sync_context(train_model)
    optimizer, kind = make_optimizer(train_model, cfg, device)
    say(f"optimizer: AdamW ({kind})")
    scaler = distributed.grad_scaler(device, b.precision == "fp16", train_model)
    loader, sampler = data_loader(b)
    guard = guard or RunGuard(b, run_dir.path, say, lambda: [g["params"] for g in optimizer.param_groups])
    # Checkpoints, resume, signals: restores the saved state and positions the data (train/resume.py).
    stream = guard.start(model, optimizer, scaler, loader, sampler)

    def reopen(epoch: int, start: int):
        """A new stream at a sample position for the current micro-batch (after an OOM)."""
        guard.stream = BatchStream(*data_loader(b), b.cfg.optim.batch_size, epoch, start)
        return guard.stream

    # OOM: free, halve the micro-batch, double accumulation, redo the step (train/oom.py)
    oom = oom_lib.OomGuard(b, reopen, optimizer, scaler, say, stream)
    batches = oom.batches()
    first = guard.first_step
    step_model, compiled = train_model, {"compile": False, "compile_error": None, "compile_s": None}
    if cfg.model.compile and first < b.total_steps:  # RESUME=1 rewriting final/ trains no step
        step_model, batches, compiled = compile_guard.compile_model(train_model, batches, device, b.precision, say)
    evaluator = Evaluator(b, run_dir, say, b.val_collate)
    effective = cfg.effective_batch_size(b.world.world_size)
    timer = StepTimer(device)  # data wait vs compute; CUDA events, read only at log points
    batches = BatchCounter(timer.wrap(batches))  # rows and real/padded tokens (SFT batches vary in both)
    seen = steady_at = interval_at = (0, 0, 0)  # (rows, real, padded tokens) after whole steps
    base = guard.samples_at(first)  # samples trained before this session (a resumed run)

    def totals(counts) -> tuple[int, int]:
        """(samples, tokens) since the run began, earlier sessions included (as counted where
        the checkpoint has the counts; older checkpoints: steps x effective batch)."""
        if guard.counted_before is not None:
            return guard.counted_before[0] + counts[0], guard.counted_before[1] + counts[1]
        per_row = counts[1] / counts[0] if counts[0] else b.max_length
        return base + counts[0], round(base * per_row) + counts[1]

    guard.counted = lambda: totals(distributed.sum_across(b.world, batches.counts()))

    gpu = monitor_lib.GpuMonitor((device.index or 0) if device.type == "cuda" else None)
    gpu.start()
    if gpu.note:
        say(gpu.note)  # once per run: why avg_gpu_util and the VRAM total are null
    host = monitor_lib.HostMemoryPeaks()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    skip = steady_start(b.total_steps)
    t0 = time.perf_counter()
    steady_t0 = t0
    first_step_s = None
    if skip == 0:
        timer.start_steady()
    interval_t0 = t0
    loss = None
    exit_reason = "completed"
    done = first
    # disable=None: a live bar on a terminal; in a log file the progress lines are printed instead
    bar = tqdm(
        total=b.total_steps, initial=first, desc=cfg.run.mode, unit="step", dynamic_ncols=True,
        disable=None if b.world.is_main else True,
    )
    def one_step():
        """One optimizer step; a failed attempt (an OOM, redone smaller) leaves no count behind."""
        mark = batches.counts()
        try:
            return train_step(
                step_model, optimizer, scaler, batches, o.gradient_accumulation_steps, o.grad_clip, device,
                b.precision, gradient_sync,
            )
        except BaseException:
            batches.rows, batches.real, batches.padded = mark
            raise

    try:
        for step in range(first, b.total_steps):
            position, warmup, total = guard.schedule_at(step)  # (step, warmup, total) unless the batch changed
            lr = lr_at(position, o.learning_rate, warmup, total, o.min_lr_ratio)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss_t, norm_t, _ = oom.step(one_step)
            timer.step_end()
            done = step + 1
            last = step + 1 == b.total_steps
            log_due = (step + 1) % cfg.run.log_every == 0 or last
            eval_due = evaluator.due(step + 1, last)
            if log_due or eval_due or done - first == skip or first_step_s is None:
                # all ranks' rows and tokens (TOKEN_BUDGET batches differ between ranks), summed
                # only where a figure needs them: the same steps on every rank
                seen = distributed.sum_across(b.world, batches.counts())
            if done - first == skip or first_step_s is None:
                synchronize(device)
                now = time.perf_counter()
                if first_step_s is None:
                    first_step_s = now - t0
                if done - first == skip:
                    steady_t0, steady_at = now, seen
                    timer.start_steady()
            bar.update(1)
            if log_due:
                wait_s, compute_s = timer.take_interval()
                loss_t, wait_s = distributed.mean_across(b.world, loss_t, wait_s)
                loss = loss_t.item()  # the one host sync, only when a line is due
                now = time.perf_counter()
                span = now - interval_t0
                row = {
                    "step": step + 1,
                    "samples": totals(seen)[0],
                    "tokens": totals(seen)[1],
                    "loss": loss,
                    "lr": lr,
                    "grad_norm": norm_t.item(),
                    "samples_per_sec": (seen[0] - interval_at[0]) / span,
                    "data_wait_frac": exposed_wait_frac(wait_s, compute_s, span),
                    "compute_frac": min(1.0, compute_s / span) if span > 0 else None,
                    "elapsed_s": now - t0,
                }
                run_dir.metrics(row)
                postfix = {"loss": f"{loss:.3f}", "samples/s": f"{row['samples_per_sec']:.1f}"}
                if device.type == "cuda":
                    postfix["VRAM"] = f"{torch.cuda.max_memory_allocated(device) / 2**20:.0f}MB"
                bar.set_postfix(postfix)
                train_s = now - t0 - evaluator.seconds
                eta = train_s / (step + 1 - first) * (b.total_steps - step - 1)
                line = (
                    f"step {step + 1}/{b.total_steps} loss {loss:.4f} lr {lr:.2e} "
                    f"samples/s {row['samples_per_sec']:.1f} data-wait {row['data_wait_frac'] or 0:.0%} "
                    f"ETA {format_eta(eta)}" + (" (input-bound)" if (row["data_wait_frac"] or 0) > INPUT_BOUND_FRAC else "")
                )
                if bar.disable:
                    say(line)
                else:
                    run_dir.log(line)
                warning = host.sample()
                if warning:
                    say(warning)
                if not math.isfinite(loss):
                    say(f"warning: loss is {loss} at step {step + 1}")
                interval_t0, interval_at = now, seen
            if eval_due:
                spent = evaluator.run(step + 1, totals(seen)[0])
                steady_t0, interval_t0 = steady_t0 + spent, interval_t0 + spent  # throughput: training only
            stop = guard.step_done(step + 1, loss_t, synced=log_due)  # save every SAVE_EVERY; signals; NaN
            if not stop and eval_due:
                stop = val_stop(b, evaluator, guard, step + 1, say)
            if stop:
                exit_reason = stop
                break
    except oom_lib.OutOfMemoryStop as err:
        exit_reason = "out_of_memory"
        say(f"error: {err}")
    finally:
        bar.close()
        guard.close()
        synchronize(device)
        gpu_summary = gpu.stop()
        steady_split = timer.steady_totals()
    end = time.perf_counter()
    seen = distributed.sum_across(b.world, batches.counts())
    if exit_reason == "interrupted":
        say(f"interrupted at step {done}; saving what was trained")
    guard.finish(done, exit_reason)

    steps_done = done
    run_steps = done - first  # this session's steps (a resumed run started at `first`)
    steady_steps = max(0, run_steps - skip)
    steady_s = (end - steady_t0 if steady_steps else end - t0) - guard.seconds_saving_since(steady_t0, end)
    steady_steps = steady_steps or run_steps
    # Throughput on real tokens and rows counted as they passed (SFT batches vary in both).
    start_at = steady_at if run_steps > skip else (0, 0, 0)
    rows, real = seen[0] - start_at[0], seen[1] - start_at[1]
    samples_per_sec = rows / steady_s if steady_s > 0 and run_steps else None
    n_params = count_params(model)
    seq_len = round(seen[1] / seen[0]) if seen[0] else b.max_length  # pretraining: max_length
    fpt = flops_per_token(n_params, **shape(model.config), seq_len=seq_len)
    tokens_per_sec = real / steady_s if samples_per_sec else None
    wait_s, compute_s = steady_split if steady_split and run_steps > skip else (None, None)
    data_wait_frac = exposed_wait_frac(wait_s, compute_s, steady_s) if wait_s is not None else None
    torch_mem = monitor_lib.torch_memory(device)
    estimate = estimate_for_run(model.config, n_params, cfg, b.max_length, b.precision, device.type)
    summary = {
        "mode": cfg.run.mode,
        "run_name": run_dir.path.name,
        "device": str(device),
        "device_name": device_name(device),
        "world_size": 1,
        "model_size": b.model_size,
        "n_params": n_params,
        "precision": b.precision,
        "batch_size": o.batch_size,
        "gradient_accumulation_steps": o.gradient_accumulation_steps,
        "effective_batch_size": effective,
        "max_length": b.max_length,
        "num_workers": cfg.data.num_workers,
        "steps": steps_done,
        "samples": totals(seen)[0],
        "tokens": totals(seen)[1],
        "padding_efficiency": seen[1] / seen[2] if seen[2] else None,
        "wall_time_s": end - t0,
        "time_to_first_step_s": first_step_s,
        "steady_state_steps": steady_steps,
        "samples_per_sec": samples_per_sec,
        "tokens_per_sec": tokens_per_sec,
        "step_time_ms": 1000 * steady_s / steady_steps if steady_steps else None,
        "data_wait_frac": data_wait_frac,
        "data_wait_s": wait_s,
        "compute_s": compute_s,
        "compute_frac": min(1.0, compute_s / steady_s) if compute_s is not None and steady_s > 0 else None,
        "input_bound": data_wait_frac is not None and data_wait_frac > INPUT_BOUND_FRAC,
        "peak_vram_mb": torch_mem["peak_allocated_mb"],
        "estimate_peak_mb": estimate["peak"] / MIB,
        "estimate_mb": {k: v / MIB for k, v in estimate.items() if k != "n_params"},
        "peak_vram_reserved_mb": torch_mem["peak_reserved_mb"],
        "vram_total_mb": gpu_summary.get("vram_total_mb") or torch_mem["total_mb"],
        "avg_gpu_util": gpu_summary.get("avg_gpu_util"),
        "gpu_monitor": gpu_summary,
        "host_memory": host.summary(),
        "flops_per_token": fpt,
        **mfu_report(tokens_per_sec, fpt, device_name(device) if device.type == "cuda" else None,
                     b.precision, tf32=cfg.system.tf32),
        "final_loss": loss,
        **evaluator.summary(),
        **compiled,
        "exit_reason": exit_reason,
        **guard.summary(),
        **b.summary_extra,
        "oom_retries": oom.retries,
        "oom_events": oom.events,
    }
    return distributed.add_rank_figures(summary, b.world, device)


def data_loader(b: Built):
    if b.make_loader is not None:
        return b.make_loader(b)
    from train.data import make_loader

    w = b.world
    return make_loader(
        b.dataset, b.cfg.data, b.cfg.optim.batch_size, b.cfg.system.seed, b.device, rank=w.rank, world_size=w.world_size
    )


def val_stop(b: Built, evaluator: Evaluator, guard: RunGuard, steps_done: int, say) -> str | None:
    """A non-finite validation loss means non-finite weights, whatever the training loss said:
    the same stop as NAN_PATIENCE non-finite training losses (no final/ of those weights)."""
    if b.cfg.run.nan_patience == 0:
        return None
    loss = evaluator.last
    bad = loss is not None and not math.isfinite(loss)
    if not distributed.max_across(b.world, [int(bad)])[0]:  # every rank stops at the same step
        return None
    from train.checkpoint import list_checkpoints

    saved = list_checkpoints(guard.manager.folder)
    if saved:
        then = f"newest good checkpoint: {saved[0].name}; lower LEARNING_RATE and resume with RESUME=1"
    else:
        then = "no checkpoint yet; lower LEARNING_RATE and start again"
    guard.stop_detail = f"validation loss is {loss} at step {steps_done}; {then}"
    say("stopping: " + guard.stop_detail)
    return "non_finite_loss"


def format_eta(seconds: float) -> str:
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def train(cfg: TrainConfig, world: distributed.Dist = distributed.SINGLE) -> int:
    """One run. With several processes (torchrun) every rank trains; only rank 0 prints and writes."""
    say = Console() if world.is_main else distributed.Quiet()
    if not world.is_main:  # N copies of transformers' loading bars and notes help no one
        import transformers

        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()
    with capture_warnings(say):  # library warnings reach train.log too
        return _train(cfg, say, world)


def _train(cfg: TrainConfig, say, world: distributed.Dist) -> int:
    if cfg.run.dry_run:
        from train.dryrun import dry_run

        return dry_run(cfg, say)
    r = cfg.run
    if cfg.optim.auto_batch:  # AUTO_BATCH=1: find-batch sets BATCH_SIZE x GRADIENT_ACCUM first
        from train.find_batch import auto_batch

        auto_batch(cfg, say)
    claims = []

    def claim():
        """Rank 0 claims and locks the run folder for the run's life (train/rundir.py)."""
        claims.append(claim_run_dir(r.output_dir, r.run_name, r.launcher, r.overwrite, r.resume))
        return claims[0].path

    run_path = distributed.on_main(world, claim)
    try:
        return _run(cfg, say, world, run_path)
    finally:
        if claims:  # the lock, and the folder too if the run stopped before writing to it
            claims[0].release()


def _run(cfg: TrainConfig, say, world: distributed.Dist, run_path) -> int:
    say(f"{cfg.run.mode}: resolving settings")
    b = distributed.main_first(world, lambda: build(cfg, say, world))
    # RESUME=1: the newest valid checkpoint is found and loaded here, before the folder is touched.
    guard = RunGuard(b, run_path, say, lambda: [g["params"] for g in make_optimizer(b.model, cfg, b.device)[0].param_groups])
    if guard.complete:
        return 0
    if world.is_main:
        run_dir = RunDir(run_path, cfg.run.overwrite, resume=guard.resuming)
    else:
        run_dir = distributed.NullRunDir(run_path)
    say.attach(run_dir)
    from train.dryrun import config_lines

    say("resolved config:")
    for line in config_lines(cfg):
        say(line)
    n_params = count_params(b.model)
    effective = cfg.effective_batch_size(world.world_size)
    processes = f" x {world.world_size} processes" if world.world_size > 1 else ""
    batch, shown = cfg.optim.batch_size, effective
    if cfg.data.token_budget is not None:  # SFT: rows vary per micro-batch; the epoch's mean
        rows = b.summary_extra["batch_size"]
        batch = f"~{rows:.1f} (TOKEN_BUDGET={cfg.data.token_budget})"
        shown = f"~{rows * cfg.optim.gradient_accumulation_steps * world.world_size:.0f}"
    say(
        f"run {run_path}  model {b.model_size} ({n_params / 1e6:.1f}M params)  precision {b.precision}  "
        f"batch {batch} x accum {cfg.optim.gradient_accumulation_steps}{processes} = effective {shown}  "
        f"max_length {b.max_length}  workers {cfg.data.num_workers}  steps {b.total_steps}"
    )
    run_dir.write(
        "config.json",
        {
            "config": asdict(cfg),
            "resolved": {
                "device": str(b.device),
                "precision": b.precision,
                "model_size": b.model_size,
                "max_length": b.max_length,
                "total_steps": b.total_steps,
                "warmup_steps": b.warmup_steps,
                "effective_batch_size": effective,
                "tokens_per_step": cfg.tokens_per_step(b.max_length, world.world_size),
                "world_size": world.world_size,
                "n_params": n_params,
                "model_config": b.model.config.to_dict(),
            },
            "decisions": b.decisions,
            "versions": {"torch": torch.__version__, "transformers": _version("transformers")},
        },
    )
    summary = run_loop(b, run_dir, say, guard)
    exit_code = guard.exit_code(summary["exit_reason"])
    if guard.resuming and guard.first_step == b.total_steps and world.is_main:
        summary = earlier_summary(run_dir.path, summary)  # RESUME=1 only rewrote final/
    try:
        finish(b, run_dir, summary, world)
        plot_curves(run_dir.path)  # never raises: a chart must not fail a finished run
        report(summary, run_dir, say)
    finally:
        run_dir.close()
    return exit_code


def _version(package: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(package)
    except Exception:
        return None

