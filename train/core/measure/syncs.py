"""Count the operations that make the host wait for the device (host syncs), each named by the
line that caused it.

On a GPU the host queues kernels ahead of the device; an op whose result the host must read
(`.item()`, `bool(t)`, `float(t)`), whose output size depends on the data (nonzero,
masked_select, unique, repeat_interleave without output_size, boolean-mask indexing), or a copy
from the device to the CPU, stops the queue until the device catches up: idle silicon.

`HostSyncs` is a TorchDispatchMode (it sees every aten op, forward and backward) with a
TorchFunctionMode beside it (it sees `.tolist()`, `.numpy()`, `.cpu()`, which on a CPU tensor
never reach the dispatcher). On an accelerator a tensor is a device tensor by where it lives.
On the CPU, where every tensor lives on the host, the counter plays the GPU's part so that the
same code can be proven sync-free on a CPU-only machine: the batches a loader hands over
(`host_batches`) are host tensors until `.to(...)` moves them, tensors made from host tensors
only stay host, and everything else (parameters, activations, gradients, optimizer state,
factory results) is a device tensor. Limit: on the CPU a device tensor's `.to("cpu")` cannot be
told from a move to the (CPU) device, so it is not counted there; on a GPU it is (a copy to cpu).
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

aten = torch.ops.aten

# output size depends on the values: the host must learn it before allocating
_DATA_DEPENDENT = {
    aten.nonzero.default, aten.nonzero.out, aten.masked_select.default, aten.argwhere.default,
    aten._unique.default, aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default,
    aten.unique_dim_consecutive.default, aten.bincount.default, aten.equal.default,
}
_REPEAT = {aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor}
_INDEX = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
_HOST_READS = {"tolist", "numpy", "cpu"}  # Tensor methods that read a device tensor on the host
_SKIP = (os.path.dirname(torch.__file__), os.path.abspath(__file__), "<frozen", "contextlib.py")


@dataclass(frozen=True)
class Sync:
    op: str
    where: str  # file:line (function) of the first frame outside torch: the line that asked

    def __str__(self) -> str:
        return f"{self.op} at {self.where}"


def _caller() -> str:
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_SKIP):
        frame = frame.f_back
    if frame is None:
        return "?"
    code = frame.f_code
    return f"{_short(code.co_filename)}:{frame.f_lineno} ({code.co_name})"


def _short(path: str) -> str:
    for marker in ("site-packages/", f"{os.sep}train{os.sep}", f"{os.sep}tests{os.sep}"):
        if marker in path:
            cut = path.index(marker)
            return path[cut + len("site-packages/"):] if marker == "site-packages/" else path[cut + 1:]
    return path


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


class _Functions(TorchFunctionMode):
    def __init__(self, owner: HostSyncs):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owner = self.owner
        name = getattr(func, "__name__", "")
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if first is not None and owner.simulated and not owner._in_host:
            if name in _HOST_READS and first.device.type == "cpu" and owner.on_device(first):
                owner.record(f"Tensor.{name}")
        out = func(*args, **kwargs)
        if first is not None and name == "to" and owner.simulated and not owner._in_host:
            # a host batch moved to the (simulated) device: a device tensor from now on
            if isinstance(out, torch.Tensor) and owner.is_host(first) and _names_device(args[1:], kwargs):
                owner.host.pop(out, None)
        return out


def _names_device(args, kwargs) -> bool:
    targets = [*args, kwargs.get("device")]
    return any(
        isinstance(a, (torch.device, str)) or (isinstance(a, torch.Tensor)) for a in targets if a is not None
    )


class HostSyncs(TorchDispatchMode):
    """with HostSyncs(device) as s: ...; s.syncs is the list of Sync, s.count their number.
    device: the run's device (on "cpu" the GPU's part is played, see the module doc)."""

    def __init__(self, device: torch.device | str = "cpu"):
        super().__init__()
        self.simulated = torch.device(device).type == "cpu"
        self.syncs: list[Sync] = []
        self.host = WeakIdKeyDictionary()  # simulated: tensors that live on the host
        self._in_host = False
        self._functions = _Functions(self)

    # -- what is a device tensor --

    def is_host(self, t: torch.Tensor) -> bool:
        return t in self.host if self.simulated else t.device.type == "cpu"

    def on_device(self, t: torch.Tensor) -> bool:
        return not self.is_host(t)

    def mark_host(self, tree) -> None:
        if self.simulated:
            for t in _tensors(tree):
                self.host[t] = True

    def host_batches(self, batches):
        """Wrap a batch iterator: what it yields (and everything made while making it) is host data."""
        while True:
            self._in_host = True
            try:
                batch = next(batches)
            finally:
                self._in_host = False
            self.mark_host(batch)
            yield batch

    # -- counting --

    @property
    def count(self) -> int:
        return len(self.syncs)

    def record(self, op: str) -> None:
        self.syncs.append(Sync(op, _caller()))

    def summary(self) -> str:
        return "; ".join(f"{n} x {s}" for s, n in Counter(self.syncs).items()) or "none"

    def __enter__(self):
        super().__enter__()
        self._functions.__enter__()
        return self

    def __exit__(self, *exc):
        self._functions.__exit__(*exc)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = _tensors((args, kwargs))
        if not self._in_host:
            reason = self._sync_reason(func, args, kwargs, inputs)
            if reason:
                self.record(reason)
        out = func(*args, **kwargs)
        # torch.tensor(python data) (aten.lift_fresh) is host data until moved: the host
        # all-reduces of a few ints (train/distributed) never touch the device
        made_on_host = func is aten.lift_fresh.default
        if self.simulated and (
            self._in_host or made_on_host or (inputs and all(self.is_host(t) for t in inputs))
        ):
            self.mark_host(out)
        return out

    def _sync_reason(self, func, args, kwargs, inputs) -> str | None:
        device_inputs = [t for t in inputs if self.on_device(t)]
        if not device_inputs:
            return None
        name = func.overloadpacket.__name__
        if func is aten._local_scalar_dense.default:
            return "item()/bool()/float() (aten._local_scalar_dense)"
        if func in _DATA_DEPENDENT:
            return f"data-dependent shape (aten.{name})"
        if func in _REPEAT and kwargs.get("output_size") is None and (len(args) < 3 or args[2] is None):
            return "data-dependent shape (aten.repeat_interleave without output_size)"
        if func in _INDEX and any(
            t.dtype in (torch.bool, torch.uint8) and self.on_device(t) for t in _tensors(args[1])
        ):
            return f"data-dependent shape (boolean-mask aten.{name})"
        if not self.simulated and func in (aten._to_copy.default, aten.copy_.default):
            dst = kwargs.get("device") if func is aten._to_copy.default else args[0].device
            src = args[0] if func is aten._to_copy.default else args[1]
            if dst is not None and torch.device(dst).type == "cpu" and src.device.type != "cpu":
                return f"copy to cpu (aten.{name})"
        return None
