"""Terms of the peak-memory estimate that a tracked CPU step does not show by itself: packed rows'
attention grid (seen on CPU, but shaped by the data, not by BATCH_SIZE x MAX_LENGTH), and what only
a GPU has (cuBLAS workspaces; sdpa's math path for T5's trained position bias, with the math
path's fp32 upcast). Each GPU term states its assumption: none of them can be measured here, so
they are written from torch's and transformers' code and the H200 profile in bench/RESULTS.md.
"""

from __future__ import annotations

from dataclasses import dataclass

# cuBLAS takes its workspace from torch's caching allocator (counted by max_memory_allocated):
# assumed 32 MiB per handle on Hopper (torch's default CUBLAS_WORKSPACE_CONFIG there), one handle
# for the forward's stream and one for the autograd engine's backward thread.
CUBLAS_WORKSPACE_BYTES = 2 * 32 * 2**20


@dataclass(frozen=True)
class PackedGrid:
    """PACKING=1's varlen attention (train/core/attention.py): a micro-batch's conversations are
    gathered into (conversations, heads, longest, head_dim) for one causal sdpa, so q, k, v and the
    output take conversations x longest token slots, not the rows' tokens. per_row: conversations
    per packed row (the packing's mean); longest: the longest conversation (a micro-batch of many
    rows holds one near it)."""

    per_row: float
    longest: int

    def slots(self, batch_size: int) -> float:
        return batch_size * self.per_row * self.longest

    def scores(self, batch_size: int) -> float:
        """(query, key) pairs per head of the grid's causal sdpa (materialised on the math path)."""
        return batch_size * self.per_row * self.longest**2


def packed_grid_of(dataset) -> PackedGrid | None:
    """The grid of a PackedRows dataset (rows of encoded conversations); None for any other."""
    rows, examples = getattr(dataset, "rows", None), getattr(dataset, "examples", None)
    if rows is None or examples is None or not len(rows) or "input_ids" not in examples[rows[0][0]]:
        return None  # not conversations (preference pairs' packed rows: the mode's bound)
    lengths = getattr(examples, "lengths", None)  # the SFT cache's, read without touching each example
    longest = int(max(lengths)) if lengths is not None and len(lengths) else max(
        (len(e["input_ids"]) for e in examples), default=1)
    return PackedGrid(per_row=sum(len(r) for r in rows) / len(rows), longest=max(1, longest))


def packed_extra(
    grid: PackedGrid,
    batch_size: int,
    max_length: int,
    hidden: int,
    heads: int,
    precision_half: bool,
    per_score: float,
) -> float:
    """Bytes per layer the grid adds over the row-shaped count: the gathered q, k, v and sdpa's
    output (what the kernel saves) at the grid's slots in place of the rows' tokens, and on the
    math path (per_score > 0) the scores at the grid's pairs in place of rows x MAX_LENGTH^2."""
    ab = 2 if precision_half else 4
    slots = 4 * ab * hidden * max(0.0, grid.slots(batch_size) - batch_size * max_length)
    scores = per_score * heads * max(0.0, grid.scores(batch_size) - batch_size * max_length**2)
    return slots + scores


def reference_forward_bytes(hidden: int, width: int, vocab: int, tokens: int, half: bool, mlp: str,
                            chunk_elements: int) -> float:
    """REFERENCE=copy: the frozen copy's forward (no grad) runs after the policy's, every policy
    activation still alive, so its own temporaries stack on them: the widest moment of a block's
    feed-forward (read on CPU: GPT-2's Python tanh-GELU holds its input, 0.5x and two
    of its steps at once, 16 bytes per MLP element in fp32, 8 under autocast; a fused activation half
    that, a gated one its gate, up, activation and product), a few residual-width tensors, and one
    chunk of the head's logits (4 bytes an element, 2 under autocast: read on CPU from the allocator's
    events, live_bytes.allocated_peak)."""
    per = {"python_gelu": (16, 8), "fused": (8, 4), "gated": (16, 8)}[mlp][half]
    residual = 6 if half else 12
    head = (2 if half else 4) * min(tokens * vocab, chunk_elements)
    return tokens * (per * width + residual * hidden) + head


def cuda_math_per_score(dropout: bool) -> float:
    """Bytes per saved score of sdpa's math path on CUDA. Assumed from torch's
    _scaled_dot_product_attention_math: half-precision inputs are upcast to fp32 (the default
    allowFP16BF16ReductionMathSDP is off), so the softmax output is fp32 (4), dropout adds its
    bool mask (1) and the fp32 dropped probabilities the value matmul saves (4); the same in fp32."""
    return 9.0 if dropout else 4.0


def t5_takes_math_on_cuda(s: dict) -> bool:
    """T5's relative position bias reaches sdpa as a float mask that requires grad. Assumed: CUDA's
    sdpa runs it on the math path (the H200 profile of T5 small, bench/RESULTS.md 2026-11-27, shows
    the materialised softmax and its backward, _safe_softmax and softmax_backward_data, in every layer)."""
    return bool(s.get("bias_mask"))
