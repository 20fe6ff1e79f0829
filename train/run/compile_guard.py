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


class GuardedModel:
    """Calls the compiled model; if it raises, calls the eager one instead, from then on. If the
    eager call raises too, the fault is not compile's and that error propagates."""

    def __init__(self, compiled, eager, on_failure):
        self.compiled, self.eager, self.on_failure = compiled, eager, on_failure

    def __call__(self, *args, **kwargs):
        if self.compiled is None:
            return self.eager(*args, **kwargs)
        try:
            return self.compiled(*args, **kwargs)
        except OOM:
            raise
        except Exception as err:
            out = self.eager(*args, **kwargs)
            self.compiled = None
            self.on_failure(err)
            return out

    def __getattr__(self, name):
        return getattr(self.eager, name)  # parameters(), config, train(): the eager module's


def compile_model(model, batches, device: torch.device, precision: str, say):
    """(model to train with, batch stream, info for summary.json). Without COMPILE, the model
    and stream unchanged; with it, a trial step decides between compiled and eager."""
    info = {"compile": False, "compile_error": None, "compile_s": None}
    if not getattr(torch, "compile", None):
        info["compile_error"] = f"torch {torch.__version__} has no torch.compile"
        say(f"warning: COMPILE=1 but {info['compile_error']}; training without it (eager)")
        return model, batches, info

    def failed(err: BaseException) -> None:
        info["compile"], info["compile_error"] = False, short_reason(err)
        _reset_dynamo()
        say(f"warning: torch.compile failed ({info['compile_error']}); training without it (eager)")

    start = time.perf_counter()
    try:
        compiled = torch.compile(model, backend=BACKEND)
    except Exception as err:  # e.g. a Python version this torch's dynamo does not support
        failed(err)
        return model, batches, info
    first = next(batches)
    batches = itertools.chain([first], batches)
    from train.core.step import forward_loss

    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):  # the trial leaves dropout's RNG untouched
            forward_loss(compiled, first, device, precision).backward()
    except OOM:
        raise
    except Exception as err:
        failed(err)
        return model, batches, info
    finally:
        model.zero_grad(set_to_none=True)  # the trial's gradients never reach a step
    info["compile"], info["compile_s"] = True, time.perf_counter() - start
    say(
        f"torch.compile ({BACKEND}): first step compiled in {info['compile_s']:.1f}s (kept out of throughput)"
    )
    return GuardedModel(compiled, model, failed), batches, info


def _reset_dynamo() -> None:
    try:
        torch._dynamo.reset()  # drop the half-built caches and guards of the failed attempt
    except Exception:
        pass
