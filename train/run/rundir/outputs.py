"""What a run leaves behind: final/ (written whole, train/run/rundir/folder.py), then summary.json, and the
closing lines on the console."""

from __future__ import annotations

import contextlib
import json

from train.core import files
from train.core.errors import UsageError
from train.distributed import parallel, process_group
from train.run.rundir.folder import RunDir, point_latest, save_model, write_failed


def save_final(plan, run_dir: RunDir, step: int, state_dict: dict | None = None) -> None:
    """final/: save_pretrained (safetensors) and the tokenizer, loads offline with from_pretrained;
    written whole or not at all (train/run/rundir/folder.py). A sharded model passes its gathered state dict.
    """
    save_model(plan, run_dir.path / "final", step, state_dict)


def check_saveable(plan) -> None:
    """What final/ needs, checked before the first step: a config whose generation settings
    transformers refuses to save (a MODEL_CONFIG with pad_token_id -5) once failed the run after
    it had trained, with no final/ and no summary.json. One line naming where they came from."""
    import copy

    m = plan.cfg.model
    source = next(
        (
            f"{var}={value}"
            for var, value in (
                ("GENERATION_CONFIG", m.generation_config),
                ("MODEL_CONFIG", m.model_config),
                ("MODEL_PATH", m.model_path),
            )
            if value
        ),
        ("the model's config"),
    )
    gen = getattr(plan.model, "generation_config", None)
    try:
        plan.model.config.to_json_string()
        if gen is not None:
            gen = copy.deepcopy(gen)
            gen.use_cache = True  # as save_model writes it
            gen.validate(strict=True)  # what save_pretrained runs
    except Exception as err:  # ValueError of transformers' checks, TypeError of a value JSON cannot hold
        lines = [x.strip() for x in str(err).splitlines() if x.strip()]
        why = next(
            (x.lstrip("- ") for x in lines if x.startswith("- ")), lines[0] if lines else type(err).__name__
        )
        raise UsageError(
            f"{source}: final/ could not be saved with these settings ({why.split('. ')[0]}); "
            "fix them before training"
        ) from None


def finish(plan, run_dir: RunDir, summary: dict, world: process_group.Dist) -> None:
    """final/, then summary.json: with the run folder's complete final/ marker, a summary.json
    says the run is finished, which RESUME=1 relies on to leave it alone. A run stopped by a
    failed append or checkpoint (a full disk) writes no final/ (RESUME=1 continues from the checkpoint): its
    summary.json where the disk still takes it, then the append's one line."""
    full_state = parallel.full_state_dict(plan.model)  # sharded: a gather every rank joins
    stopped = summary["exit_reason"] == "write_failed"
    if not summary["exit_reason"].startswith("non_finite") and not stopped:  # never a final/ of NaN weights
        try:
            process_group.on_main(world, lambda: save_final(plan, run_dir, summary["steps"], full_state))
        except UsageError as err:
            summary["final_error"] = str(err)
            with contextlib.suppress(OSError):  # the run's figures, if the disk still takes them
                run_dir.write("summary.json", summary)
            raise
    if stopped:
        # a checkpoint that did not fit (the guard's line) or a failed append (the run folder's)
        line = summary.get("write_error") or run_dir.failed or "rank 0 could not write the run folder"
        summary["write_error"] = line
        try:
            run_dir.write("summary.json", summary)
        except OSError:
            line += " (summary.json could not be written either)"
        raise UsageError(line)  # rank 0's line is the one shown
    try:
        run_dir.write("summary.json", summary)
    except OSError as err:
        raise UsageError(write_failed(run_dir.path / "summary.json", err.errno or 0)) from None
    # only now, and only a completed run: never one in progress, interrupted, stopped or failed
    if world.is_main and summary["exit_reason"] == "completed":
        point_latest(run_dir.path)


def earlier_summary(path, summary: dict) -> dict:
    """The summary.json of the session that trained the last step, where it was written (the
    figures of a zero-step session are no figures); else this session's."""
    try:
        earlier = json.loads(files.read_text(path / "summary.json"))
    except (OSError, ValueError, files.LinkRefused):
        return summary
    if isinstance(earlier, dict) and earlier.get("exit_reason") and earlier.get("steps") == summary["steps"]:
        earlier.pop("final_error", None)
        return earlier
    return summary
