"""torch.compile with a fallback to eager, as the guides advise: a setup where compile fails
(old torch, no Triton, an unsupported backend or Python) trains anyway, with one warning line,
and the summary says compile was off and why.

torch.compile is lazy: wrapping succeeds and errors surface at the first call, in the forward
or, for the backward graph, in the first backward. So the first micro-batch is run once as a
trial (forward and backward) before training starts; its gradients are dropped and the RNG
state is restored, so the run continues exactly as it would have without the trial, and the
batch is handed back to the stream. A later forward failure (a recompilation for a new shape)
also switches to eager for the rest of the run; that call is redone in eager, and it had
produced no gradient.
"""

from __future__ import annotations

import itertools
import time

import torch

from train.run.compile import cuda_graphs

BACKEND = "inductor"  # torch.compile's default; tests swap in a cheaper or a failing one
# Running out of memory is not a compile failure: eager would run out too. (torch.OutOfMemoryError
# is recent; older torch has only the CUDA one.)
OOM = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError


def short_reason(err: BaseException) -> str:
    """One line: the exception type and the first line of its message, cut to 200 characters.
    Dynamo's wrapper ("backend='inductor' raised:") gets the wrapped error's line appended."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    first = lines[0] if lines else ""
    inner = getattr(err, "inner_exception", None) or err.__cause__
    if first.endswith(":") and inner is not None:
        inner_lines = [line.strip() for line in str(inner).splitlines() if line.strip()]
        first += f" {type(inner).__name__}: {inner_lines[0] if inner_lines else ''}"
    elif first.endswith(":") and len(lines) > 1:
        first += " " + lines[1]
    text = f"{type(err).__name__}: {first}" if first else type(err).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def mark_shapes(kwargs: dict, bucketed: bool) -> dict:
    """Tell dynamo which sizes vary, before its first trace. bucketed (batches padded to the length
    buckets, SFT and DPO): every length dim (and the rows, which TOKEN_BUDGET varies) dynamic from
    the first call, so one graph serves every bucket: one compile, not one per bucket (up to 8,
    each a whole inductor compile), and CUDA graphs (COMPILE_MODE=reduce-overhead) record one
    replay per bucket under it. A packed row's conversations x longest (varlen_index) vary with
    every batch: dynamic too. The loss's divisor num_items_in_batch, a host int that changes with
    every SFT batch, goes in as a 0-dim tensor made by a fill on the batch's device (no copy from
    the host, no sync): as an int dynamo would guard on its value and recompile at the second one."""
    items, ids = kwargs.get("num_items_in_batch"), kwargs.get("input_ids")
    if isinstance(items, int) and torch.is_tensor(ids):
        kwargs["num_items_in_batch"] = torch.full((), items, dtype=torch.long, device=ids.device)
    if bucketed:
        for value in kwargs.values():
            if torch.is_tensor(value) and value.dim() >= 2:
                for dim in range(value.dim()):
                    torch._dynamo.maybe_mark_dynamic(value, dim)
    index, place = kwargs.get("varlen_index"), kwargs.get("varlen_place")
    if index is not None:
        torch._dynamo.maybe_mark_dynamic(index, 0)
        torch._dynamo.maybe_mark_dynamic(index, 1)
    if place is not None and bucketed:  # DPO's flat row per micro-batch: its token count varies too
        torch._dynamo.maybe_mark_dynamic(place, 0)
    return kwargs


class GuardedModel:
    """Calls the compiled model; if it raises, calls the eager one instead, from then on. If the
    eager call raises too, the fault is not compile's and that error propagates. strict (the
    trial step): the compiled call's error propagates, for compile_model to judge."""

    strict = False

    def __init__(self, compiled, eager, on_failure, bucketed: bool = False):
        self.compiled, self.eager, self.on_failure = compiled, eager, on_failure
        self.bucketed = bucketed

    def __call__(self, *args, **kwargs):
        if self.compiled is None:
            return self.eager(*args, **kwargs)
        try:
            return self.compiled(*args, **mark_shapes(kwargs, self.bucketed))
        except OOM:
            raise
        except Exception as err:
            if self.strict:
                raise
            out = self.eager(*args, **kwargs)
            self.compiled = None
            self.on_failure(err)
            return out

    @property
    def _orig_mod(self):
        """torch.compile's own name for the module inside, while compiled: forward_loss then
        hands the model no all-ones mask (traced, it would cost sdpa its causal fast path)."""
        if self.compiled is None:
            raise AttributeError("_orig_mod")  # back on eager: no compiled module inside
        return self.eager

    def __getattr__(self, name):
        return getattr(self.eager, name)  # parameters(), config, train(): the eager module's


def not_compiled() -> dict:
    """summary.json's compile entries of a run without COMPILE (or before it is tried)."""
    return {
        "compile": {
            "enabled": False,
            "mode": None,
            "graph_breaks": None,
            "recompiles": None,
            "graphs": None,
            "cuda_graphs": None,
            "cudagraph_skips": None,
        },
        "compile_error": None,
        "compile_s": None,
    }


def _counted() -> tuple[int, int, int]:
    """(graph breaks, graphs, CUDA graphs inductor skipped) in torch's own counters, process-wide."""
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"], cuda_graphs.skips()


class Counts:
    """Dynamo's graph breaks and graphs since the trial began, read at summary time: the trial's
    graphs are the first compile, every graph after them a recompile (a new shape dynamo was not
    told of, a new guard). Under CUDA graphs, the recordings on the device (one per bucket, its
    forward and backward apart) and the graphs inductor left uncaptured. Evaluation runs the
    eager model (train/run/loop/evaluate.py) and adds none."""

    def __init__(self, device: torch.device, mode: str):
        self.device, self.mode = device, mode
        self.breaks, self.graphs, self.skips = _counted()
        self.first = None

    def trial_done(self) -> None:
        self.first = _counted()[1] - self.graphs

    def __call__(self) -> dict:
        breaks, graphs, skips = _counted()
        graphs -= self.graphs
        graphed = self.mode == cuda_graphs.GRAPHS and self.device.type == "cuda"
        return {"graph_breaks": breaks - self.breaks, "graphs": graphs,
                "recompiles": max(0, graphs - (self.first or graphs)),
                "cuda_graphs": cuda_graphs.recorded(self.device) if graphed else None,
                "cudagraph_skips": skips - self.skips if graphed else None}


def compile_model(model, batches, device: torch.device, precision: str, say, bucketed: bool = False,
                  layout=None, objective=None, mode: str = "default"):
    """(model to train with, batch stream, info for summary.json). Without COMPILE, the model
    and stream unchanged; with it, a trial step decides between compiled and eager. info's
    "compile" entry is filled in from dynamo's counters when summary.json is written
    (finish_counts). bucketed: mark_shapes's (batches padded to the length buckets). layout: the
    family's (train/models Family.layout), for the trial step. objective: the
    step's (train_step's; None: the token loss): the trial compiles the calls training makes.
    mode: COMPILE_MODE (reduce-overhead: CUDA graphs; inductor's alone, other backends ignore it)."""
    info = not_compiled()
    if not getattr(torch, "compile", None):
        info["compile_error"] = f"torch {torch.__version__} has no torch.compile"
        say(f"warning: COMPILE=1 but {info['compile_error']}; training without it (eager)")
        return model, batches, info
    _reset_dynamo()  # a fresh cache: an earlier model compiled in this process must not count
    counts = info["counts"] = Counts(device, mode)

    def failed(err: BaseException) -> None:
        info["compile"]["enabled"], info["compile_error"] = False, short_reason(err)
        _reset_dynamo()
        say(f"warning: torch.compile failed ({info['compile_error']}); training without it (eager)")

    start = time.perf_counter()
    try:
        options = {"mode": mode} if BACKEND == "inductor" and mode != "default" else {}
        compiled = torch.compile(model, backend=BACKEND, **options)
    except Exception as err:  # e.g. a Python version this torch's dynamo does not support
        failed(err)
        return model, batches, info
    first = next(batches)
    batches = itertools.chain([first], batches)
    from train.core.step import TokenObjective

    objective = objective or TokenObjective(layout)

    devices = [device] if device.type == "cuda" else []
    guarded = GuardedModel(compiled, model, failed, bucketed)
    guarded.strict = True  # the trial compiles what training will call: the same shape marks
    # CUDA graphs: the first call runs as cudagraph trees' warm-up, the second records; both are tried
    trials = 2 if mode == cuda_graphs.GRAPHS and device.type == "cuda" else 1
    # an objective whose step makes its own rows (GRPO's rollout) makes the trial's from the loader's batch
    trial_batch = getattr(objective, "trial_batch", None)
    try:
        with torch.random.fork_rng(devices=devices):  # the trial leaves dropout's RNG untouched
            for _ in range(trials):
                model.zero_grad(set_to_none=True)
                batch = first if trial_batch is None else trial_batch(guarded, first)
                loss, _ = objective.loss(
                    guarded, batch, device, precision, objective.counts([batch]), 1, False
                )
                loss.backward()
    except OOM:
        raise
    except Exception as err:
        failed(err)
        return model, batches, info
    finally:
        model.zero_grad(set_to_none=True)  # the trial's gradients never reach a step
        guarded.strict = False
    counts.trial_done()
    info["compile"]["enabled"], info["compile"]["mode"] = True, mode
    info["compile_s"] = time.perf_counter() - start
    say(f"torch.compile ({BACKEND}, mode {mode}): first step compiled in {info['compile_s']:.1f}s (kept out "
        f"of throughput)")
    return guarded, batches, info


def finish_counts(info: dict) -> dict:
    """info (compile_model's) with its live counters read into the "compile" entry, for summary.json."""
    info = dict(info)
    counts = info.pop("counts", None)
    if counts is not None:
        info["compile"] = {**info["compile"], **counts()}
    return info


def _reset_dynamo() -> None:
    try:
        torch._dynamo.reset()  # drop the half-built caches and guards of the failed attempt
    except Exception:
        pass
