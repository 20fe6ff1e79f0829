"""CUDA graphs under COMPILE_MODE=reduce-overhead (torch's cudagraph trees): what the step keeps
clear of, and what a run reports of them.

A graph replays a micro-batch's recorded kernels with one launch. Its hazards, and where the kit
meets each:
- inputs: the trees copy each call's tensors into the graph's own static buffers, so a batch may
  live anywhere; the length buckets bound the shapes, hence the recordings (one per bucket).
- outputs: the next replay overwrites them. train_step reads each micro-batch's loss (and, on a log
  step, its logits) before the next forward, into eager tensors of its own.
- gradients: the backward's outputs live in the graphs' memory pool; with .grad unset, autograd
  keeps that very tensor as .grad, and with gradient accumulation the next micro-step's replay
  overwrites it (torch stops with "accessing gradient tensor output of CUDAGraphs that has been
  overwritten"). keep_grads makes every .grad once, outside the pool, and zeroes them in place.
- host syncs: none inside a micro-step (tests/test_host_syncs.py); inductor leaves a graph with
  CPU work uncaptured and counts it (cudagraph_skips in summary.json).
- the optimizer step runs eager, outside the graphs: only the model is compiled.
"""

from __future__ import annotations

import torch

GRAPHS = "reduce-overhead"


def keep_grads(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every trained parameter's .grad made now (zeros, outside the graphs' pool), and the
    optimizer's zero_grad from now on zeroing them in place, whatever train_step asks: backward
    then adds each replay's gradients into them instead of keeping a replay's own buffer."""
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    zero = optimizer.zero_grad

    def zero_grad(set_to_none: bool = True) -> None:
        zero(set_to_none=False)

    optimizer.zero_grad = zero_grad


def skips() -> int:
    """Graphs inductor compiled but left uncaptured (CPU ops, mutated inputs ...), process-wide."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["cudagraph_skips"]


def recorded(device: torch.device) -> int | None:
    """CUDA graphs recorded on the device's cudagraph tree (forward and backward of each shape
    count apart); None off CUDA."""
    if device.type != "cuda":
        return None
    try:
        from torch._inductor import cudagraph_trees

        manager = cudagraph_trees.get_manager(device.index or 0, create_if_none_exists=False)
    except Exception:  # a private API: a torch without it reports no count rather than failing the run
        return None
    if manager is None or manager.roots is None:
        return 0
    count, nodes = 0, [n for roots in manager.roots.values() for n in roots]
    while nodes:
        node = nodes.pop()
        count += 1
        nodes.extend(child for children in node.children.values() for child in children)
    return count
