"""A model config checked before anything is built: a type transformers does not know, a kind the
kit cannot train, a shape that cannot be built or trained. One line each (UsageError), never a
traceback from deep in transformers or a failure after training."""

from __future__ import annotations

import copy
import json
import math

from train.core.errors import UsageError
from train.models.family import family_of


def load_json(text: str):
    """json.loads of a config file, nesting past the interpreter's recursion limit as a ValueError
    like any other bad JSON (a RecursionError escaped every handler: 200,000 brackets were a
    traceback)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deep to be a model config") from None


def refuse_other_kinds(cfg, variable: str) -> None:
    """A model type this kit cannot train: one line naming what it trains, never transformers'
    list of every config class."""
    if family_of(cfg) is None:
        raise UsageError(
            f"{variable}: model type {getattr(cfg, 'model_type', None)!r} is neither a causal LM (gpt2, "
            f"llama, "
            "qwen2, mistral ...) nor an encoder-decoder LM (t5, mt5, bart ...); this kit trains those two "
            "kinds"
        )


def refuse_unknown_type(model_type, variable: str, hint: str = "") -> None:
    """A model_type transformers does not know: one short line, not transformers' own error,
    which lists every model type it has (11,745 characters on one line)."""
    from transformers import CONFIG_MAPPING

    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise UsageError(
            f"{variable}: unknown model_type {str(model_type)[:80]!r}; this kit trains causal LMs (gpt2, "
            f"llama, qwen2 ...) and encoder-decoders (t5, bart ...){hint}"
        )


def check_shape(cfg, variable: str) -> None:
    """A model that cannot be built or trained (no layers, a width the heads do not divide)
    stops here in one line, not in a traceback from deep in transformers, or after training."""

    def whole(name: str, value) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"{variable}: {name} must be a whole number >= 1, got {value!r}")
        return value

    try:
        layers, hidden, heads = cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads
    except AttributeError as err:
        raise UsageError(f"{variable}: not a decoder config this kit can train ({err})") from None
    whole("the number of layers (n_layer / num_hidden_layers)", layers)
    whole("the width (n_embd / hidden_size)", hidden)
    whole("the number of heads (n_head / num_attention_heads)", heads)
    if getattr(cfg, "head_dim", None) is None and getattr(cfg, "d_kv", None) is None and hidden % heads:
        raise UsageError(f"{variable}: the width {hidden} (n_embd / hidden_size) is not divisible by the "
                         f"{heads} heads")
    kv = getattr(cfg, "num_key_value_heads", None)
    if kv is not None and heads % whole("num_key_value_heads", kv):
        raise UsageError(f"{variable}: {heads} attention heads are not divisible by num_key_value_heads {kv}")
    for name in ("n_positions", "max_position_embeddings", "seq_length"):
        if getattr(cfg, name, None) is not None:
            whole(f"the context length ({name})", getattr(cfg, name))
            break
    # Sizes transformers divides by or builds layers of: 0 is a ZeroDivisionError in the weight
    # init (T5's d_kv, d_ff) or at the first forward (T5's relative position buckets).
    for name in SIZE_FIELDS:
        if getattr(cfg, name, None) is not None:
            whole(name, getattr(cfg, name))
    check_buckets(cfg, variable)
    check_finite(cfg.to_dict(), variable)
    check_layers(cfg, variable)


SIZE_FIELDS = ("d_kv", "d_ff", "n_inner", "intermediate_size", "head_dim",
               "num_decoder_layers", "relative_attention_max_distance")  # fmt: skip


def check_buckets(cfg, variable: str) -> None:
    """T5's relative positions: the encoder halves the buckets and takes half of those as exact
    offsets, then divides by log(max_distance / exact); fewer than 4 buckets, or a distance not
    beyond the decoder's exact half, divides by zero or indexes outside the table."""
    buckets = getattr(cfg, "relative_attention_num_buckets", None)
    distance = getattr(cfg, "relative_attention_max_distance", None)
    if buckets is None:
        return
    if isinstance(buckets, bool) or not isinstance(buckets, int) or buckets < 4:
        raise UsageError(f"{variable}: relative_attention_num_buckets must be a whole number >= 4, got "
                         f"{buckets!r}")
    if distance is not None and distance <= buckets // 2:
        raise UsageError(
            f"{variable}: relative_attention_max_distance ({distance}) must be larger than half of "
            f"relative_attention_num_buckets ({buckets})"
        )


def check_finite(values: dict, variable: str, prefix: str = "") -> None:
    """Every float of a model config finite: a NaN layer_norm_epsilon trains NaN from the first
    step and would end advising a lower LEARNING_RATE."""
    for key, value in values.items():
        if isinstance(value, dict):
            check_finite(value, variable, f"{prefix}{key}.")
        elif isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"{variable}: {prefix}{key} is {value}; a model config's numbers must be finite")


# Where a config names its experts: Mixtral, Qwen3-MoE, GPT-OSS (num_local_experts), Qwen2-MoE,
# OLMoE, Jamba (num_experts), DeepSeek (n_routed_experts).
EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
ACTIVATIONS = ("activation_function", "hidden_act", "hidden_activation")


def check_layers(cfg, variable: str) -> None:
    """What transformers looks up only while building the model (a KeyError for an unknown
    activation or rope_type), or builds and trains without a word (rope_theta 0: non-finite from
    the first step; a negative rope factor: trains and ships final/); and a mixture of experts,
    whose router loss the kit's chunked loss (on the bare model) leaves out."""
    experts = max((n for name in EXPERTS if isinstance(n := getattr(cfg, name, None), int)), default=0)
    if experts > 1 or hasattr(cfg, "output_router_logits"):
        raise UsageError(
            f"{variable}: a mixture-of-experts model "
            f"({cfg.model_type}{f', {experts} experts' if experts > 1 else ''}): "
            "the kit's loss is the language model's alone, without its router's load-balancing loss "
            "(router_aux_loss_coef), so its experts would train unbalanced; this kit trains dense models"
        )
    from transformers.activations import ACT2FN

    for name in ACTIVATIONS:
        act = getattr(cfg, name, None)
        if act is not None and (not isinstance(act, str) or act not in ACT2FN):
            raise UsageError(f"{variable}: {name} {act!r} is not an activation transformers has "
                             f"({', '.join(sorted(ACT2FN)[:8])} ...)")  # fmt: skip
    check_rope(cfg, variable)


def check_raw(raw: dict, variable: str) -> None:
    """A config file's values checked before transformers reads them: its special ids in its own
    vocabulary, and the rope settings transformers only warns about as it reads them (that warning
    came before the one line)."""
    from types import SimpleNamespace

    check_ids(raw, variable)
    check_rope(
        SimpleNamespace(**{k: raw.get(k) for k in ("rope_parameters", "rope_scaling", "rope_theta")}),
        variable,
    )


# The ids the model itself indexes with: the pad row of the embeddings (Llama's padding_idx), an
# encoder-decoder's first decoder input. bos and eos are not among them: GPT2Config's default 50256
# beside a 448-token vocabulary trains (the kit's generate() settings carry the tokenizer's eos).
SPECIAL = ("pad_token_id", "decoder_start_token_id")


def check_ids(values: dict, variable: str) -> None:
    """A config's special token ids within its own vocabulary (values: the config as a dict):
    pad_token_id 99999999 was an AssertionError from torch's Embedding while building. Negative
    ids count from the end, as torch's padding index does (early LLaMA folders have pad -1)."""
    vocab = values.get("vocab_size")
    vocab = vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else None
    for name in SPECIAL:
        ids = values.get(name)
        for i in ids if isinstance(ids, list) else [ids]:
            if i is None:
                continue
            if (
                isinstance(i, bool)
                or not isinstance(i, int)
                or (vocab is not None and not -vocab <= i < vocab)
            ):
                raise UsageError(f"{variable}: {name} {i!r} is not one of the model's {vocab} token ids "
                                 "(a whole number from 0 to vocab_size - 1)")  # fmt: skip


def check_rope(cfg, variable: str) -> None:
    """Rotary positions (rope_parameters, or rope_scaling and rope_theta in older configs): a
    rope_type transformers has, a base (rope_theta) and a factor above 0. One set of them, or
    one per layer type (Gemma 3's full and sliding attention)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None)
    sets = (
        {"": rope}
        if not isinstance(rope, dict) or not all(isinstance(v, dict) for v in rope.values())
        else {f"{layer}.": values for layer, values in rope.items()}
    )
    theta = getattr(cfg, "rope_theta", None)
    for layer, values in sets.items():
        values = values if isinstance(values, dict) else {}
        kind = values.get("rope_type", values.get("type", "default"))
        if kind != "default" and kind not in ROPE_INIT_FUNCTIONS:
            raise UsageError(f"{variable}: {layer}rope_type {kind!r} is not one transformers has "
                             f"(default, {', '.join(ROPE_INIT_FUNCTIONS)})")  # fmt: skip
        for name, value in (
            ("rope_theta", values.get("rope_theta", theta)),
            ("factor", values.get("factor")),
        ):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0
            ):
                what = f"{layer}{name}" if name == "rope_theta" else f"the rope_scaling {layer}{name}"
                raise UsageError(
                    f"{variable}: {what} is {value!r}; it must be a number above 0 "
                    f"({'10000 is usual' if name == 'rope_theta' else '1 leaves positions as they are'})"
                )


# The model a config describes, on the meta device: shapes and parameter counts with nothing allocated
# (estimate.py's figures start here), and refuse_unbuilt, the one check every model's config passes before
# anything is built or loaded.


def count_params(hf_cfg) -> int:
    """Unique parameters of the model a config describes, built on the meta device (shapes
    only: nothing is allocated), so every architecture transformers knows is counted exactly.
    Every block has the same shape, so a deep model is counted from its one- and two-block
    versions: 100,000 layers take milliseconds instead of minutes of building modules."""
    layers = hf_cfg.num_hidden_layers
    # an encoder-decoder has two stacks: counted whole
    if layers > 2 and not family_of(hf_cfg).layout.encoder_decoder:
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
        raise UsageError(
            f"{variable}: transformers cannot build this model ({type(err).__name__}: {why})"
        ) from None
    have, what = capacity or (None, "")
    if have is not None and n * 4 > have:
        raise UsageError(f"{variable}: this model ({n / 1e9:,.2f}B parameters) cannot be built here: its "
                         f"float32 "
                         f"weights alone take {n * 4 / 2**30:,.1f} GiB, {what} has {have / 2**30:,.1f} GiB")
    return n
