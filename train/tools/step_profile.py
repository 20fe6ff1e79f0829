"""One optimizer step of a real run under torch.profiler: where its time goes.

    python -m train.tools.step_profile --json FILE [--step K] COMMAND [training flags]

COMMAND is pretrain, sft, dpo or grpo (the launchers' commands; `SHOW_COMMAND=1 ./train_sft_custom.sh`
prints a launcher's flags) or doctor (its short run). A GRPO step holds its rollout: the sampling, the
rewards and the loss's pass. The run is the real one, unchanged: torch's
global optimizer-step hook marks the step boundaries, so no line of the loop knows it is watched.
Step K (0-based; default 1, the second) is traced: its time from the end of optimizer step K-1
to the end of step K, with a device sync at both ends so the window holds exactly that step's
kernels (the step then starts with an empty queue, as a step after a host sync does). Step 1 is
inside the warm-up the run's throughput leaves out (train/run/loop/meter.py: 2 steps of a 20-step
run), so tracing it costs the run's figures nothing; the compile trial runs before step 0.

FILE gets: the step's wall ms, the ms the GPU was busy (union of kernels, copies and sets) and
its share of the step, the top ops by self device time (self CPU time on a CPU, where there are
no kernels), kernel time by category (matmul, attention, fused/Triton, optimizer, copies ...),
and whether dynamo compiled a graph inside the step (its time is then compile, not a steady step).
AUTO_BATCH=1 and DRY_RUN=1 are refused: find-batch's trial steps would be counted as the run's.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from train.core.errors import UsageError
from train.core.files import write_json

COMMANDS = ("pretrain", "sft", "dpo", "grpo", "doctor")
MARK = "step_profile: profiled step"
TOP = 8
# kineto's activity types of work on the device (not its annotations, runtime calls or syncs)
DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
# kernel name fragments -> category; the first that matches wins (attention before matmul:
# fused attention kernels hold gemms of their own; a Triton kernel that fuses a norm is a norm)
CATEGORIES = (
    ("attention", ("flash", "fmha", "attention", "sdpa", "flex", "cudnn_attn")),
    ("matmul", ("gemm", "cutlass", "xmma", "cublas", "nvjet", "matmul", "_mm_", "bmm", "addmm")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("copy / set", ("memcpy", "memset", "copy")),
    ("norm / softmax / loss", ("norm", "softmax", "cross_entropy", "nll", "log_softmax", "reduce")),
    ("fused (Triton)", ("triton",)),
)


def category(kernel: str) -> str:
    name = kernel.lower()
    return next((cat for cat, parts in CATEGORIES if any(p in name for p in parts)), "other elementwise")


def busy_ns(intervals: list[tuple[int, int]], lo: int, hi: int) -> int:
    """Length of the union of intervals clipped to [lo, hi] (kernels on several streams overlap)."""
    total, end = 0, lo
    for start, stop in sorted(intervals):
        start, stop = max(start, end), min(stop, hi)
        if stop > start:
            total += stop - start
            end = stop
    return total


def timeline(prof) -> tuple[tuple[int, int] | None, list[tuple[str, int, int]]]:
    """(the profiled step's window, or None; device work as (name, start, end)), in ns of the
    profiler's one clock (kineto puts the GPU's timestamps on the host's)."""
    events = prof.profiler.kineto_results.events()
    marks = [(e.start_ns(), e.end_ns()) for e in events if e.name() == MARK]
    work = [(e.name(), e.start_ns(), e.end_ns()) for e in events if _device_work(e)]
    return (marks[0] if marks else None), work


def _device_work(event) -> bool:
    """A kernel, copy or set on the device. torch before 2.13 has no activity_type (torch 2.11's
    _KinetoEvent, seen on an H200): there, an event on the device that is not an annotation."""
    if hasattr(event, "activity_type"):
        return event.activity_type() in DEVICE_WORK
    from torch.autograd import DeviceType

    return event.device_type() != DeviceType.CPU and not event.is_user_annotation()


def host_ops(prof) -> list[dict]:
    """The ops the host called, with their kernels' time (self_device_time_total) and their own
    CPU time; the kernels themselves are ranked by category."""
    from torch.autograd import DeviceType

    return [
        {
            "name": a.key,
            "device_ms": a.self_device_time_total / 1e3,
            "cpu_ms": a.self_cpu_time_total / 1e3,
            "calls": a.count,
        }
        for a in prof.key_averages()
        if a.key != MARK and getattr(a, "device_type", DeviceType.CPU) == DeviceType.CPU
    ]


def summarize(
    window, work: list, ops: list[dict], wall_s: float, compiled: bool, step: int, device: str
) -> dict:
    """The JSON record of one traced step (see the module docstring)."""
    busy = cats = None
    if work and window is not None:
        busy = busy_ns([(start, end) for _, start, end in work], *window) / 1e6
        per: dict[str, float] = {}
        for name, start, end in work:
            per[category(name)] = per.get(category(name), 0.0) + (end - start) / 1e6
        total = sum(per.values()) or 1.0
        cats = [
            {"name": k, "device_ms": v, "share": v / total}
            for k, v in sorted(per.items(), key=lambda kv: -kv[1])
        ]
    key = "device_ms" if work else "cpu_ms"
    top = [op for op in sorted(ops, key=lambda op: op[key], reverse=True)[:TOP] if op[key] > 0]
    step_ms = (window[1] - window[0]) / 1e6 if window is not None else 1000 * wall_s
    return {
        "step": step,
        "device": device,
        "step_ms": step_ms,
        "device_busy_ms": busy,
        "device_busy_frac": busy / step_ms if busy is not None and step_ms > 0 else None,
        "ranked_by": "self device time" if work else "self CPU time (no device kernels)",
        "top_ops": top,
        "kernel_categories": cats,
        "compiled_during_step": compiled,
    }


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


class OneStep:
    """The global optimizer-step hook: traces optimizer step `step` of the run (counting every
    optimizer.step() in the process from the start)."""

    def __init__(self, step: int):
        self.step, self.done, self.prof, self.result = step, 0, None, None
        self.cuda = torch.cuda.is_available()

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def __call__(self, optimizer, args, kwargs) -> None:
        self.done += 1
        if self.done == self.step and self.prof is None:
            from torch.profiler import ProfilerActivity, profile, record_function

            self._sync()  # step K-1's kernels stay out of the window
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            self.prof = profile(activities=activities)
            self.prof.start()
            self.graphs = _graphs()
            self.mark = record_function(MARK)
            self.mark.__enter__()
            self.t0 = time.perf_counter()
        elif self.done == self.step + 1 and self.prof is not None and self.result is None:
            self._sync()  # every kernel of step K inside the window
            self.mark.__exit__(None, None, None)
            wall = time.perf_counter() - self.t0
            self.prof.stop()
            device = "cuda" if self.cuda else "cpu"
            window, work = timeline(self.prof)
            self.result = summarize(
                window, work, host_ops(self.prof), wall, _graphs() != self.graphs, self.step, device
            )


def run(command: str, rest: list[str]) -> int:
    """The command as `python -m train` runs it (single process)."""
    if command == "doctor":
        from train.tools.doctor import doctor_main

        return doctor_main(rest)
    from train.config.flags import parse_training_args
    from train.run.pipeline import train

    cfg = parse_training_args(command, rest)
    if cfg.optim.auto_batch or cfg.run.dry_run:
        raise UsageError("step_profile: AUTO_BATCH=1 and DRY_RUN=1 are not profiled (find-batch's trial "
                         "steps would be counted as the run's; a dry run has no step)")
    return train(cfg)


def lines(r: dict) -> list[str]:
    """The console summary of a record."""
    busy = "n/a (no device kernels)" if r["device_busy_frac"] is None else \
        f"{r['device_busy_ms']:.1f} ms = {r['device_busy_frac']:.0%} of the step"
    out = [f"step_profile: step {r['step']} took {r['step_ms']:.1f} ms; device busy {busy}"
           + ("; dynamo compiled a graph inside it" if r["compiled_during_step"] else "")]
    for c in r["kernel_categories"] or []:
        out.append(f"  {c['name']:<24} {c['device_ms']:9.2f} ms  {c['share']:.0%} of kernel time")
    out.append(f"  top ops by {r['ranked_by']}:")
    for op in r["top_ops"]:
        ms = op["device_ms"] if r["device_busy_frac"] is not None else op["cpu_ms"]
        out.append(f"  {op['name'][:60]:<60} {ms:9.2f} ms  x{op['calls']}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m train.tools.step_profile", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--json", required=True, help="where the step's record goes")
    parser.add_argument("--step", default="1", help="the optimizer step to trace, 0-based (>= 1; default 1)")
    parser.add_argument("command", help="pretrain, sft, dpo, grpo or doctor")
    parser.add_argument("flags", nargs=argparse.REMAINDER, help="the command's flags")
    args = parser.parse_args(argv)
    if args.command not in COMMANDS:
        print(f"error: step_profile COMMAND: expected one of {', '.join(COMMANDS)}, got {args.command!r}",
              file=sys.stderr)
        return 2
    if not args.step.isdigit() or int(args.step) < 1:
        print(f"error: step_profile --step: expected a whole number >= 1, got {args.step!r}", file=sys.stderr)
        return 2
    hook = OneStep(int(args.step))
    handle = register_optimizer_step_post_hook(hook)
    try:
        code = run(args.command, args.flags)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        handle.remove()
    record = hook.result or {"step": hook.step, "error": f"the run ended after {hook.done} optimizer "
                             f"step(s), before step {hook.step} was over"}
    write_json(Path(args.json), {"command": args.command, **record})
    print("\n".join(lines(record)) if hook.result else f"step_profile: {record['error']}")
    return code


if __name__ == "__main__":
    sys.exit(main())
