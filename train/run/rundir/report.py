"""What a run tells: the resolved config (console and config.json), summary.json, and the
closing lines. Built from what the other parts measured; nothing here changes the run."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
from dataclasses import asdict, fields, replace
from pathlib import Path

import torch

from config import FIELD_SECTION, SECTIONS, TrainConfig, env_name
from train.config import knobs
from train.core import files
from train.core.device import device_name
from train.core.errors import UsageError
from train.core.measure.mfu import mfu_report
from train.core.model import count_params, unwrapped
from train.core.units import MIB
from train.distributed import process_group
from train.models.estimate import estimate_for_run
from train.models.family import dropout_of
from train.models.flops import model_flops_per_token
from train.models.freeze import trainable_of
from train.observe import monitor as monitor_lib
from train.run.compile.wrapper import finish_counts


def config_lines(cfg: TrainConfig, plan=None) -> list[str]:
    """The resolved config, one line per section, as launcher variables; plan: what it
    decided where the field says otherwise (resolved_fields)."""
    shown = resolved_fields(plan) if plan is not None else {}
    lines = []
    for section, klass in SECTIONS.items():
        part = getattr(cfg, section)
        items = []
        for f in fields(klass):
            value = shown.get(f.name, getattr(part, f.name))
            if isinstance(value, bool):
                value = int(value)
            items.append(f"{env_name(f.name)}={'' if value is None else value}")
        lines.append(f"  {section}: " + " ".join(items))
    return lines


def resolved_fields(plan) -> dict:
    """Fields whose value in the config is not the run's: MODEL_SIZE left empty (the plan's size,
    or a loaded model's label), MODEL_FAMILY where the model is not MODEL_SIZE's (MODEL_CONFIG's or
    MODEL_PATH's own type: a T5 folder showed MODEL_FAMILY=gpt2), VAL_FRACTION beside VAL_PATH."""
    shown = {"model_size": plan.model_size}
    model_type = getattr(getattr(unwrapped(plan.model), "config", None), "model_type", None)
    if isinstance(model_type, str):
        shown["model_family"] = model_type
    if plan.cfg.data.val_path is not None:
        shown["val_fraction"] = "(unused:VAL_PATH)"
    return shown


def start_line(plan, run_path, total_steps: int) -> str:
    """run ... model ... precision ... batch x accum (x processes) = effective ... steps ..."""
    cfg, world = plan.cfg, plan.world
    n_params = count_params(plan.model)
    processes = f" x {world.world_size} processes" if world.world_size > 1 else ""
    batch, shown = cfg.optim.batch_size, cfg.effective_batch_size(world.world_size)
    if cfg.data.token_budget is not None:  # SFT: rows vary per micro-batch; the epoch's mean
        rows = plan.summary_extra["batch_size"]
        batch = f"~{rows:.1f} (TOKEN_BUDGET={cfg.data.token_budget})"
        shown = f"~{rows * cfg.optim.gradient_accumulation_steps * world.world_size:.0f}"
    # DROPOUT as the model holds it: the kit's 0, a loaded model's own, or set
    dropout = dropout_of(plan.model)
    shown_dropout = "" if dropout is None else f", dropout {dropout:g}"
    return (
        f"run {run_path}  model {plan.model_size} ({n_params / 1e6:.1f}M params{shown_dropout})  precision "
        f"{plan.precision}  "
        f"batch {batch} x accum {cfg.optim.gradient_accumulation_steps}{processes} = effective {shown}  "
        f"max_length {plan.max_length}  workers {cfg.data.num_workers}  steps {total_steps}"
    )


def config_record(plan, guard=None, asked: TrainConfig | None = None) -> dict:
    """config.json: the config as resolved, the numbers derived from it, every automatic
    decision with its reason, and the library versions. guard: RESUME=1's continuation (its
    steps and warm-up, and the re-planned total_steps as the last decision). asked: the
    settings the command gave, before the plan's decisions, which RESUME=1 keeps where it
    sets none again (train/run/guard/carry.py)."""
    cfg, world = plan.cfg, plan.world
    source = guard if guard else plan
    total, warmup = source.total_steps, source.warmup_steps
    replanned = [guard.replanned] if guard and guard.replanned else []
    return {
        "config": asdict(cfg),
        **({"asked": asdict(asked), "asked_sha256": asked_seal(asdict(asked))} if asked is not None else {}),
        "resolved": {
            "device": str(plan.device),
            "precision": plan.precision,
            "model_size": plan.model_size,
            # the model's own type (MODEL_PATH's, MODEL_CONFIG's)
            "model_family": resolved_fields(plan).get("model_family"),
            "max_length": plan.max_length,
            "total_steps": total,
            "warmup_steps": warmup,
            "effective_batch_size": cfg.effective_batch_size(world.world_size),
            "tokens_per_step": cfg.tokens_per_step(plan.max_length, world.world_size),
            "world_size": world.world_size,
            "n_params": count_params(plan.model),
            "n_trainable_params": trainable_of(plan.model).params,
            "dropout": dropout_of(plan.model),
            "model_config": plan.model.config.to_dict(),
        },
        "decisions": [*plan.decisions, *replanned],
        "versions": {"torch": torch.__version__, "transformers": _version("transformers")},
    }

def asked_seal(asked) -> str:
    """sha256 of config.json's "asked" block as the kit writes it: RESUME=1 refuses a config.json whose
    settings were edited since (train/run/guard/carry.py)."""
    return hashlib.sha256(json.dumps(files.json_safe(asked), sort_keys=True).encode()).hexdigest()


def flat_asked(asked) -> dict | None:
    """config.json's (or a checkpoint's) "asked" block as one flat {field: value}, or None."""
    if not isinstance(asked, dict):
        return None
    flat = {}
    for section in asked.values():
        if isinstance(section, dict):
            flat.update({k: v for k, v in section.items() if k in FIELD_SECTION})
    return flat


def asked_settings(run_path: Path) -> dict | None:
    """The flat settings the run's command asked for (config.json's "asked"), or None (a run from
    before they were saved, or a folder whose config.json is unreadable or a link)."""
    try:
        record = json.loads(files.read_text(run_path / "config.json"))
    except (OSError, ValueError, files.LinkRefused):
        return None
    return flat_asked(record.get("asked") if isinstance(record, dict) else None)


def summary(plan, run_dir, meter, parts, guard, done: int, exit_reason: str) -> dict:
    """summary.json: what the run was, what it measured, how it ended."""
    cfg, device, model = plan.cfg, plan.device, plan.model
    measured = meter.figures(done)
    n_params = count_params(model)
    seen = meter.seen
    lengths = plan.family.layout.flop_lengths(cfg.run.mode, plan.max_length, *seen[:2])
    fpt = model_flops_per_token(model, *lengths)
    torch_mem = monitor_lib.torch_memory(device)
    # the micro-batch trained at the end (the OOM guard's: smaller than the plan's after an OOM)
    now = replace(cfg, optim=replace(cfg.optim, batch_size=parts.oom_guard.batch_size,
                                     gradient_accumulation_steps=parts.oom_guard.accumulation))
    trainable = trainable_of(model)
    estimate = estimate_for_run(
        model.config,
        n_params,
        now,
        plan.max_length,
        plan.precision,
        device.type,
        plan.world.world_size,
        trainable,
    )
    gpu = meter.gpu_summary
    record = {
        "mode": cfg.run.mode,
        "run_name": run_dir.path.name,
        "device": str(device),
        "device_name": device_name(device),
        "world_size": 1,
        "model_size": plan.model_size,
        "n_params": n_params,
        "n_trainable_params": trainable.params,  # FREEZE leaves the rest untrained
        "precision": plan.precision,
        "batch_size": parts.oom_guard.batch_size,  # smaller than the plan's after an out-of-memory
        "gradient_accumulation_steps": parts.oom_guard.accumulation,
        "effective_batch_size": cfg.effective_batch_size(plan.world.world_size),
        "max_length": plan.max_length,
        "num_workers": cfg.data.num_workers,
        "steps": done,
        **measured,
        "peak_vram_mb": torch_mem["peak_allocated_mb"],
        "estimate_peak_mb": estimate["peak"] / MIB,
        "estimate_mb": {k: v / MIB for k, v in estimate.items() if k != "n_params"},
        "peak_vram_reserved_mb": torch_mem["peak_reserved_mb"],
        "vram_total_mb": gpu.get("vram_total_mb") or torch_mem["total_mb"],
        "avg_gpu_util": gpu.get("avg_gpu_util"),
        "gpu_monitor": gpu,
        "host_memory": meter.host.summary(),
        "flops_per_token": fpt,
        **mfu_report(measured["tokens_per_sec"], fpt, device_name(device) if device.type == "cuda" else None,
                     plan.precision, tf32=cfg.system.tf32),
        "final_loss": meter.loss,
        **{f"final_{name}": value for name, value in plan.objective.kept(meter.last_metrics).items()},
        **parts.evaluator.summary(),
        **finish_counts(parts.compiled),
        "exit_reason": exit_reason,
        **guard.summary(),
        **plan.summary_extra,
        "oom_retries": parts.oom_guard.retries,
        "oom_events": parts.oom_guard.events,
    }
    return process_group.add_rank_figures(record, plan.world, device)


KIT_ROOT = Path(__file__).resolve().parents[3]  # where the launchers are
LAUNCHER_SCRIPTS = ("run_single_gpu", "run_single_gpu_optimized", "train_sft_custom", "quick_start_sft_fast",
                    "train_dpo", "train_grpo")
# make's target of each side of scripts/compare.sh (its runs' launcher is compare-<script>)
COMPARE_TARGETS = {
    "run_single_gpu": "compare",
    "run_single_gpu_optimized": "compare",
    "train_sft_custom": "compare-sft",
    "quick_start_sft_fast": "compare-sft",
    "train_dpo": "compare-dpo",
    "train_grpo": "compare-grpo",
}


def launcher_defaults(launcher: str) -> dict[str, str]:
    """VARIABLE -> the non-empty default a launcher gives it at its top (`BATCH_SIZE=${BATCH_SIZE:-8}`)."""
    try:
        text = (KIT_ROOT / f"{launcher}.sh").read_text()
    except OSError:
        return {}
    return dict(re.findall(r"^([A-Z][A-Z0-9_]*)=\$\{\1:-([^}]+)\}", text, re.MULTILINE))


def set_again(run_path: Path, launcher: str) -> list[str]:
    """VARIABLE=value for each of the run's settings the launcher itself would set otherwise
    (BATCH_SIZE=4 where it defaults to 8): RESUME=1 keeps every other one (train/run/guard/carry.py)."""
    from train.config.flags import parse_value

    asked, out = asked_settings(run_path) or {}, []
    for var, default in launcher_defaults(launcher).items():
        name = var.lower()
        if (
            name not in asked
            or asked[name] is None
            or (launcher == "train_sft_custom" and var == "BATCH_SIZE")
        ):
            continue
        try:
            if parse_value(name, default) == asked[name]:
                continue
        except UsageError:
            continue
        out.append(f"{var}={int(asked[name]) if isinstance(asked[name], bool) else asked[name]}")
    where = asked.get("output_dir")
    if where and Path(where) != Path(knobs.default("output_dir")):  # where RESUME=1 looks for the run
        out.insert(0, f"OUTPUT_DIR={shlex.quote(where)}")
    return out


def resume_line(run_path: Path, launcher: str | None, batch_size: int | None = None) -> str:
    """How to continue an interrupted run, a command to run as it is: the launcher that started it
    (train_sft_custom.sh with its micro-batch argument, which would otherwise fall back to 16) with
    the settings its defaults would change; every other setting comes from the run."""
    run_name = Path(run_path).name
    target = (
        COMPARE_TARGETS.get((launcher or "").removeprefix("compare-"))
        if (launcher or "").startswith("compare-")
        else None
    )
    if target:  # scripts/compare.sh's sides: the comparison resumes as a whole, by make's own variables
        asked = asked_settings(Path(run_path)) or {}
        again = [f"COMPARE_SAMPLES={asked['max_samples']}"] if asked.get("max_samples") else []
        if target == "compare-dpo" and asked.get("data_path"):
            again.append(f"DATA_PATH={shlex.quote(str(asked['data_path']))}")
        repeat = " and REPEAT" if re.search(r"-r\d+$", run_name) else ""
        how = f"make {' '.join([target, 'RESUME=1', *again])} (with the other variables{repeat} you gave it)"
    elif launcher in LAUNCHER_SCRIPTS:
        batch = (
            f" {batch_size}"
            if launcher in ("train_sft_custom", "train_dpo", "train_grpo") and batch_size
            else ""
        )
        again = "".join(f" {item}" for item in set_again(Path(run_path), launcher))
        how = f"RESUME=1 RUN_NAME={run_name}{again} ./{launcher}.sh{batch} (its other settings are kept)"
    else:
        how = f"the same command with --resume 1 --run_name {run_name}"
    return f"interrupted: to continue from the last checkpoint, run {how}"


def closing(s: dict, run_dir, say, launcher: str | None = None) -> None:
    """The run's last lines on the console: figures, validation, memory, what to change, outputs,
    and for an interrupted run how to resume it (the last line)."""

    def fmt(value, spec):
        return "n/a" if value is None else format(value, spec)

    say(
        f"done: {s['steps']} steps, final loss {fmt(s['final_loss'], '.4f')}, "
        f"{fmt(s['samples_per_sec'], '.1f')} samples/s, {fmt(s['tokens_per_sec'], ',.0f')} tokens/s, "
        f"data-wait {fmt(s['data_wait_frac'], '.0%')}, MFU {fmt(s['mfu'], '.1%')}"
    )
    if s.get("final_val_loss") is not None:
        best = "none finite" if s["best_val_loss"] is None else (f"{s['best_val_loss']:.4f} at step "
                                                                 f"{s['best_val_step']}")
        say(f"validation: final val_loss {s['final_val_loss']:.4f}, best {best}")
    if s.get("peak_vram_mb") is not None:
        say(f"peak memory: measured {s['peak_vram_mb']:,.0f} MB, estimated {s['estimate_peak_mb']:,.0f} MB")
    if s.get("mfu_note"):
        say(f"MFU: {s['mfu_note']}")
    if s["input_bound"]:
        say(
            f"the run was input-bound: {s['data_wait_frac']:.0%} of step time waiting for data "
            "(raise NUM_WORKERS, set PIN_MEMORY=1 and PERSISTENT_WORKERS=1)"
        )
    names = (
        "summary.json",
        "metrics.jsonl",
        "train.log",
        "curves.png",
        "tensorboard/",
        "final/",
        "best/",
        "checkpoints/",
    )
    # a NaN stop writes no final/
    written = ", ".join(n for n in names if (run_dir.path / n.rstrip("/")).exists())
    say(f"outputs: {run_dir.path}/ ({written})")
    for warning in os.environ.get("KIT_NAME_WARNINGS", "").splitlines():  # scripts/common.sh's, said again
        say(f"{warning} (so it had no effect on this run)")
    if s.get("exit_reason") == "interrupted":
        say(resume_line(run_dir.path, launcher, s.get("batch_size")))


def _version(package: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(package)
    except Exception:
        return None
