"""How the model is spread over the processes: DDP around it, or FSDP2's fully_shard (ZeRO-2
or ZeRO-3 style, optionally with the optimizer in host memory), gradient sync once per
optimizer step, and the sharded checkpoint read and written through
torch.distributed.checkpoint."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.distributed as dist

from train.core.errors import UsageError
from train.distributed.process_group import Dist, _active, needs_group


def describe(world: Dist, sharding: str, offload: bool) -> str | None:
    """What wrap() will do, for the decisions in config.json (None: a plain single process)."""
    if not needs_group(world, sharding):
        return None
    if sharding == "none":
        return f"DDP over {world.world_size} processes: gradients all-reduced on the last micro-step only"
    kind = (
        "zero2 (reshard_after_forward=False: parameters stay gathered from forward to backward)"
        if sharding == "zero2"
        else "zero3 (reshard_after_forward=True: parameters gathered per block and freed again)"
    )
    where = ", parameters, gradients and AdamW state in host memory" if offload else ""
    return f"FSDP2 fully_shard over {world.world_size} process(es), {kind}{where}"


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks: the classes transformers names as not to be split across devices."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def wrap(
    model: torch.nn.Module, world: Dist, sharding: str, offload: bool, device: torch.device
) -> torch.nn.Module:
    """The module the loop trains: the model itself (one process), DDP around it, or the model
    sharded in place by fully_shard (every block its own FSDP group, then the root, which
    holds the embeddings and the tied LM head)."""
    if not needs_group(world, sharding):
        return model
    if sharding == "none":
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        # gradient_as_bucket_view: gradients live in the all-reduce buckets, no second copy.
        return DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=True)
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    options = {"reshard_after_forward": sharding == "zero3"}
    if offload:
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    for block in _blocks(model):
        fully_shard(block, **options)
    fully_shard(model, **options)
    return model


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def sync_context(model: torch.nn.Module):
    """gradient_sync(last) -> a context for one micro-step: all but the last micro-step of an
    optimizer step keep their gradients local (DDP no_sync; FSDP2 set_requires_gradient_sync),
    so the all-reduce runs once per optimizer step instead of once per micro-batch."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return lambda last: contextlib.nullcontext() if last else model.no_sync()
    if is_sharded(model):

        @contextlib.contextmanager
        def fsdp_sync(last: bool):
            model.set_requires_gradient_sync(last)
            yield

        return fsdp_sync
    return None


def build_scaler(precision: str, model: torch.nn.Module, device: torch.device):
    """The GradScaler for the run's resolved PRECISION (loss scaling only for fp16; otherwise a
    disabled scaler, so the step has one code path), the one builder every caller shares. With
    sharded gradients the overflow check must agree across ranks, or one rank steps while
    another skips (ShardedGradScaler all-reduces found_inf)."""
    enabled = precision == "fp16"
    if enabled and is_sharded(model):
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device.type)
    return torch.amp.GradScaler(device.type, enabled=enabled)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (a sharded parameter); a plain tensor as it is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def full_state_dict(model: torch.nn.Module) -> dict | None:
    """For final/ of a sharded model: the full state dict gathered onto rank 0's CPU (a
    collective: every rank calls it). None when the model is not sharded."""
    if not is_sharded(model):
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # The gather copies tied weights (LM head = embeddings) apart; alias them again so
    # save_pretrained stores one copy, as it does for an unsharded model.
    ties = getattr(model, "all_tied_weights_keys", None)
    for target, source in ties.items() if isinstance(ties, dict) else ():
        if target in state and source in state:
            state[target] = state[source]
    return state


def save_sharded(directory, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Model and optimizer state through torch.distributed.checkpoint: each rank writes its own
    shards (no gather onto one GPU). Every rank calls it with the same directory."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(Path(directory)))
    if _active():
        dist.barrier()  # measured: without it the processes abort at exit while files are written


def load_sharded(directory, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Read save_sharded's checkpoint into a model wrapped the same way (same SHARDING) and its
    freshly made optimizer. Every rank calls it with the same directory."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from train.distributed import safe_load

    path = Path(directory)
    if not (path / ".metadata").exists():
        raise UsageError(f"RESUME: {path} is not a sharded checkpoint (no .metadata)")
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    try:
        # never dcp.load's own reader: it unpickles .metadata and non-tensor entries unrestricted
        safe_load.dcp_load(state, path)
    except safe_load.Refused as err:
        raise UsageError(f"RESUME=1: checkpoint {path.parent.name} cannot be read: {err}") from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
