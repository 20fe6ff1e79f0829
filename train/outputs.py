"""What a run leaves behind: final/ (written whole, train/rundir.py), then summary.json, and the
closing lines on the console."""

from __future__ import annotations

import contextlib
import json

from train import distributed
from train.errors import UsageError
from train.rundir import RunDir, save_model, write_failed


def save_final(b, run_dir: RunDir, step: int, state_dict: dict | None = None) -> None:
    """final/: save_pretrained (safetensors) and the tokenizer, loads offline with from_pretrained;
    written whole or not at all (train/rundir.py). A sharded model passes its gathered state dict."""
    save_model(b, run_dir.path / "final", step, state_dict)


def finish(b, run_dir: RunDir, summary: dict, world: distributed.Dist) -> None:
    """final/, then summary.json: with the run folder's complete final/ marker, a summary.json
    says the run is finished, which RESUME=1 relies on to leave it alone."""
    full_state = distributed.full_state_dict(b.model)  # sharded: a gather every rank joins
    if summary["exit_reason"] != "non_finite_loss":  # never a final/ of NaN weights
        try:
            distributed.on_main(world, lambda: save_final(b, run_dir, summary["steps"], full_state))
        except UsageError as err:
            summary["final_error"] = str(err)
            with contextlib.suppress(OSError):  # the run's figures, if the disk still takes them
                run_dir.write("summary.json", summary)
            raise
    try:
        run_dir.write("summary.json", summary)
    except OSError as err:
        raise UsageError(write_failed(run_dir.path / "summary.json", err.errno or 0)) from None


def earlier_summary(path, summary: dict) -> dict:
    """The summary.json of the session that trained the last step, where it was written (the
    figures of a zero-step session are no figures); else this session's."""
    try:
        earlier = json.loads((path / "summary.json").read_text())
    except (OSError, ValueError):
        return summary
    if isinstance(earlier, dict) and earlier.get("exit_reason") and earlier.get("steps") == summary["steps"]:
        earlier.pop("final_error", None)
        return earlier
    return summary


def report(s: dict, run_dir: RunDir, say) -> None:
    def fmt(value, spec):
        return "n/a" if value is None else format(value, spec)

    say(
        f"done: {s['steps']} steps, final loss {fmt(s['final_loss'], '.4f')}, "
        f"{fmt(s['samples_per_sec'], '.1f')} samples/s, {fmt(s['tokens_per_sec'], ',.0f')} tokens/s, "
        f"data-wait {fmt(s['data_wait_frac'], '.0%')}, MFU {fmt(s['mfu'], '.1%')}"
    )
    if s.get("final_val_loss") is not None:
        best = "none finite" if s["best_val_loss"] is None else f"{s['best_val_loss']:.4f} at step {s['best_val_step']}"
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
    names = ("summary.json", "metrics.jsonl", "train.log", "curves.png", "final/", "best/", "checkpoints/")
    written = ", ".join(n for n in names if (run_dir.path / n.rstrip("/")).exists())  # a NaN stop writes no final/
    say(f"outputs: {run_dir.path}/ ({written})")
