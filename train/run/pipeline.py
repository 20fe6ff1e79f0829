"""One training run, start to end, in one direction:

    config (validated TrainConfig)  ->  build: the plan (every automatic decision and its reason,
    saved as config.json) and the objects it needs  ->  resume state (RESUME=1: the newest valid
    checkpoint, checked before the run folder is touched)  ->  run folder  ->  loop  ->
    final/, summary.json, curves and the closing lines.

`before` is the command line's step ahead of the run (DRY_RUN=1 stops after the plan: an exit
code; AUTO_BATCH=1 lets find-batch choose the micro-batch first: a plan.Chosen, an input of the
plan): tools sit above this layer.
"""

from __future__ import annotations

from functools import partial

from config import TrainConfig
from train.core.optim.optimizers import build_optimizer
from train.distributed import distributed
from train.observe.curves import plot_curves
from train.observe.tensorboard_log import NoLog, reporter
from train.run.guard.resume import RunGuard
from train.run.loop.loop import run_loop
from train.run.plan import batch_answer
from train.run.plan.build import build
from train.run.plan.fill import Fill
from train.run.plan.plan import Chosen
from train.run.rundir import report
from train.run.rundir.claim import claim_run_dir
from train.run.rundir.outputs import earlier_summary, finish
from train.run.rundir.rundir import NullRunDir, RunDir
from train.run.rundir.runlog import Console, Quiet, capture_warnings


def train(cfg: TrainConfig, world: distributed.Dist = distributed.SINGLE, before=None) -> int:
    """One run. With several processes (torchrun) every rank trains; only rank 0 prints and writes."""
    say = Console() if world.is_main else Quiet()
    if not world.is_main:  # N copies of transformers' loading bars and notes help no one
        import transformers

        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()
    with capture_warnings(say):  # library warnings reach train.log too
        ahead = before(cfg, say, world) if before else None
        return ahead if isinstance(ahead, int) else _train(cfg, say, world, ahead)


def _train(cfg: TrainConfig, say, world: distributed.Dist, chosen: Chosen | Fill | None = None) -> int:
    r = cfg.run
    claims = []

    def claim():
        """Rank 0 claims and locks the run folder for the run's life (train/run/rundir/rundir.py)."""
        claims.append(claim_run_dir(r.output_dir, r.run_name, r.launcher, r.overwrite, r.resume))
        return claims[0].path

    run_path = distributed.on_main(world, claim)
    try:
        return _run(cfg, say, world, run_path, chosen)
    finally:
        if claims:  # the lock, and the folder too if the run stopped before writing to it
            claims[0].release()


def _run(cfg: TrainConfig, say, world: distributed.Dist, run_path, chosen: Chosen | Fill | None) -> int:
    say(f"{cfg.run.mode}: resolving settings")
    plan = distributed.main_first(world, lambda: build(cfg, say, world, chosen))
    asked, cfg = cfg, plan.cfg  # as decided (the asked config is left as it was: config.json keeps both)
    # RESUME=1: the newest valid checkpoint is found and loaded here, before the folder is touched.
    def param_groups():
        """The optimizer's parameter groups, for checking a checkpoint's optimizer state against."""
        optimizer = build_optimizer(cfg.optim, plan.model, plan.device)[0]
        return [g["params"] for g in optimizer.param_groups]

    guard = RunGuard(plan, run_path, say, param_groups, asked)
    if guard.complete:
        return 0
    mirror = partial(reporter, cfg.run.report_to)  # REPORT_TO
    run_dir = (
        RunDir(run_path, cfg.run.overwrite, resume=guard.resuming, mirror=mirror)
        if world.is_main
        else NullRunDir(run_path)
    )
    mirror = getattr(run_dir, "mirror", NoLog())
    say.attach(run_dir)
    say("resolved config:")
    for line in report.config_lines(cfg, plan):
        say(line)
    say(report.start_line(plan, run_path, guard.total_steps))
    faster = batch_answer.faster_answer(plan, world.world_size)  # the kit's own measurement, offered
    if faster:
        say(faster)
    run_dir.write("config.json", report.config_record(plan, guard, asked))
    summary = run_loop(plan, run_dir, say, guard)
    exit_code = guard.exit_code(summary["exit_reason"])
    if guard.resuming and guard.first_step == guard.total_steps and world.is_main:
        summary = earlier_summary(run_dir.path, summary)  # RESUME=1 only rewrote final/
    try:
        finish(plan, run_dir, summary, world)  # final/, then summary.json
        mirror.summary(summary)
        plot_curves(run_dir.path)  # never raises: a chart must not fail a finished run
        report.closing(summary, run_dir, say, cfg.run.launcher)
    finally:
        mirror.close()
        run_dir.close()
    return exit_code
