"""The model a config describes, on the meta device: shapes and parameter counts with nothing
allocated (estimate.py's figures start here), and refuse_unbuilt, the one check every model's
config passes before anything is built or loaded."""

from __future__ import annotations

import copy

from train.core.errors import UsageError
from train.models.family import family_of


def count_params(hf_cfg) -> int:
    """Unique parameters of the model a config describes, built on the meta device (shapes
    only: nothing is allocated), so every architecture transformers knows is counted exactly.
    Every block has the same shape, so a deep model is counted from its one- and two-block
    versions: 100,000 layers take milliseconds instead of minutes of building modules."""
    layers = hf_cfg.num_hidden_layers
    if layers > 2 and not family_of(hf_cfg).source_target:  # an encoder-decoder has two stacks: counted whole
        try:
            one, two = (meta_count(with_layers(hf_cfg, n)) for n in (1, 2))
            return one + (layers - 1) * (two - one)
        except Exception:  # a config that cannot be cut to fewer layers: counted whole
            pass
    return meta_count(hf_cfg)


def meta_model(hf_cfg):
    import torch

    with torch.device("meta"):  # AutoModelForSeq2SeqLM for an encoder-decoder
        return family_of(hf_cfg).auto_class().from_config(hf_cfg, trust_remote_code=False)


def meta_count(hf_cfg) -> int:
    return sum(p.numel() for p in meta_model(hf_cfg).parameters())


def with_layers(hf_cfg, n: int):
    cut = copy.deepcopy(hf_cfg)
    cut.num_hidden_layers = n
    if isinstance(getattr(cut, "layer_types", None), list):  # one entry per layer (sliding/full ...)
        cut.layer_types = cut.layer_types[:n]
    return cut


def refuse_unbuilt(hf_cfg, variable: str, capacity: tuple[int | None, str] | None = None) -> int:
    """The parameters of the model hf_cfg describes, counted on the meta device before anything is
    built: the one check every model passes first (a new one, MODEL_PATH's, an import's; the
    training fit, estimate.refuse_unfit, starts here). One line where transformers cannot build it
    (a GPT-2 of width 1e9: a tensor past what torch can size) or, capacity (bytes, what) given,
    where its float32 weights alone exceed it (a config asking for 2 TB was an allocation
    failure, or the kernel's out-of-memory kill)."""
    try:
        n = count_params(hf_cfg)
    except UsageError:
        raise
    except Exception as err:  # RuntimeError (storage size overflow), KeyError, AssertionError ...
        why = (str(err).strip().splitlines() or [type(err).__name__])[0][:160]
        raise UsageError(f"{variable}: transformers cannot build this model ({type(err).__name__}: {why})") from None
    have, what = capacity or (None, "")
    if have is not None and n * 4 > have:
        raise UsageError(f"{variable}: this model ({n / 1e9:,.2f}B parameters) cannot be built here: its float32 "
                         f"weights alone take {n * 4 / 2**30:,.1f} GiB, {what} has {have / 2**30:,.1f} GiB")
    return n
