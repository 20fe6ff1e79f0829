"""SFT packing: several conversations per row of MAX_LENGTH tokens instead of one padded row each.

`pack` places conversations into rows by best-fit decreasing (each conversation, longest
first, goes into the row whose free space fits it most tightly), which for SFT-like length
mixes leaves a few percent of padding where one-per-row padding wastes half or more.

`PackedCollator` turns rows into batches in which no conversation can see another:
- position_ids restart at 0 for every conversation, so each is embedded as if it were alone;
- the first token of every conversation gets label -100: transformers' loss shifts labels by
  one (logits at t predict label t+1), so that label would otherwise be predicted from the
  last token of the previous conversation;
- attention: without a (T x T) mask wherever the model takes it. The rows are flattened into
  one row of real tokens; flash-attention 2's varlen kernel keeps the conversations apart by
  cu_seq_lens where flash_attn is installed (CUDA, bf16/fp16), and everywhere else
  varlen_sdpa (train/core/attention.py) runs one causal sdpa over the conversations gathered
  side by side. The dense form, a 4D block-diagonal causal mask (batch, 1, T, T), stays for a
  model that cannot switch its attention (eager-only architectures).
`attention_for` says which a model on a device should use, and why.
"""

from __future__ import annotations

import bisect
import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch
from torch.utils.data import Dataset

from train.core.attention import VARLEN_SDPA, varlen_indices
from train.core.errors import UsageError
from train.core.units import IGNORE_INDEX
from train.data.chat.batching import padded_width

FLASH = "flash_attention_2"
SDPA = "sdpa"
EAGER = "eager"
VARLEN = VARLEN_SDPA


@dataclass
class Packing:
    rows: list[list[int]]  # conversation indices per row, in the order they sit in the row
    real_tokens: int
    efficiency: float  # real tokens / (rows x max_length): padding every row to MAX_LENGTH
    efficiency_longest: float  # real tokens / (rows x the fullest row): padding to the longest row


def pack(lengths: Sequence[int], max_length: int, seed: int | None = None) -> Packing:
    """Best-fit decreasing into rows of at most max_length tokens.

    Deterministic: ties between equal lengths keep index order (seed None) or a seeded order,
    and with a seed the rows come out in a seeded shuffle (a new seed per epoch gives a new
    order). A conversation longer than max_length should have been truncated when encoded;
    one that was not is a setting mismatch, reported as such.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if max_length < 1:
        raise UsageError(f"MAX_LENGTH={max_length}: packing needs rows of at least 1 token")
    if len(lengths) and lengths.max() > max_length:
        i = int(lengths.argmax())
        raise UsageError(
            f"MAX_LENGTH={max_length}: conversation {i} has {int(lengths[i])} tokens; conversations must be "
            "truncated to MAX_LENGTH before packing"
        )
    rng = np.random.default_rng(seed) if seed is not None else None
    order = rng.permutation(len(lengths)) if rng is not None else np.arange(len(lengths))
    order = order[np.argsort(-lengths[order], kind="stable")]
    # Free space of every open row, as one sorted list of ints free * n_rows_bound + row, so a
    # bisect finds the tightest row that fits and ties go to the oldest row.
    bound = len(lengths) + 1
    free: list[int] = []
    rows: list[list[int]] = []
    for i in order.tolist():
        n = int(lengths[i])
        at = bisect.bisect_left(free, n * bound)
        if at == len(free):
            row, room = len(rows), max_length
            rows.append([])
        else:
            row, room = free[at] % bound, free[at] // bound
            del free[at]
        rows[row].append(i)
        if room - n > 0:
            bisect.insort(free, (room - n) * bound + row)
    if rng is not None:
        rows = [rows[k] for k in rng.permutation(len(rows))]
    real = int(lengths.sum())
    fullest = max((int(lengths[r].sum()) for r in rows), default=0)
    return Packing(
        rows=rows,
        real_tokens=real,
        efficiency=real / (len(rows) * max_length) if rows else 1.0,
        efficiency_longest=real / (len(rows) * fullest) if fullest else 1.0,
    )


class PackedRows(Dataset):
    """A dataset of rows: item k is the list of encoded conversations that share row k."""

    unit = "packed rows"  # what BATCH_SIZE counts
    budget_note = ""

    def __init__(self, examples: Sequence[dict], rows: Sequence[Sequence[int]]):
        self.examples, self.rows = examples, rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> list[dict]:
        return [self.examples[i] for i in self.rows[index]]


def _row_parts(row: Sequence[dict]) -> tuple[list[int], list[int], list[int], list[int]]:
    """One row's input ids, labels, position ids and segment ids (1, 2, ... per conversation)."""
    ids: list[int] = []
    labels: list[int] = []
    positions: list[int] = []
    segments: list[int] = []
    for k, example in enumerate(row, start=1):
        n = len(example["input_ids"])
        if n == 0:
            continue
        ids += list(example["input_ids"])
        labels += [IGNORE_INDEX, *list(example["labels"])[1:]]
        positions += range(n)
        segments += [k] * n
    return ids, labels, positions, segments


def block_causal_mask(segments: torch.Tensor, dtype: torch.dtype = torch.bool) -> torch.Tensor:
    """(batch, T) segment ids -> (batch, 1, T, T) mask: query t sees key s when s <= t and both
    belong to the same segment. bool (True = attend) for sdpa; a float dtype gives the additive
    form (0 / most negative) that eager attention adds to its scores. Every query sees at least
    itself, so no softmax row is empty (an empty row is NaN in sdpa)."""
    t = segments.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    allowed = (segments[:, :, None] == segments[:, None, :]) & causal
    allowed = allowed[:, None]
    if dtype == torch.bool:
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


class PackedCollator:
    """Rows of conversations (PackedRows items) -> a batch for the model.

    attention=sdpa/eager: input_ids, labels, position_ids and attention_mask (batch, 1, T, T),
    padded to the fullest row of the batch (rounded up to pad_to_multiple_of: 8 on CUDA, as
    PadCollator, where the masked kernels want aligned widths); the padding is a segment of its
    own with label -100. attention=flash_attention_2: every conversation of
    the batch in one row (1, N) without padding, position_ids, and the varlen kwargs
    cu_seq_lens_q/k (int32 tensors) and max_length_q/k (ints, as transformers'
    DataCollatorWithFlattening gives them; transformers derives the same boundaries from
    position_ids when they are missing). attention=varlen_sdpa: the same flat row, with
    varlen_index / varlen_place (train/core/attention.py) in place of the cu_seq_lens; no mask
    tensor at all. Every form carries the ints n_real_tokens, n_padded_tokens (as PadCollator)
    and n_conversations.

    widths (length_buckets, set where shapes must repeat): a masked batch pads to a bucket; a
    flat row pads to rows x the last width (MAX_LENGTH), so every full batch has one shape,
    its pad tokens labelled -100 and read by no real token (varlen_indices).
    """

    widths: tuple[int, ...] | None = None

    @property
    def length_varies(self) -> bool:
        """A masked batch padded to the length buckets varies in width; a flat row (flash, varlen) is
        rows x MAX_LENGTH, one shape (compiled: marked dynamic only where it varies)."""
        return self.widths is not None and self.attention not in (FLASH, VARLEN)

    def __init__(self, pad_token_id: int, attention: str = SDPA, pad_to_multiple_of: int = 1,
                 mask_dtype: torch.dtype = torch.float32):
        if attention not in (SDPA, EAGER, FLASH, VARLEN):
            raise ValueError(f"attention must be {SDPA}, {EAGER}, {FLASH} or {VARLEN}, got {attention!r}")
        self.pad_token_id, self.attention, self.multiple = pad_token_id, attention, pad_to_multiple_of
        self.mask_dtype = mask_dtype  # eager only: the dtype of the additive mask

    def __call__(self, rows: Sequence[Sequence[dict]]) -> dict:
        if self.attention in (FLASH, VARLEN):
            return self._flat(rows)
        parts = [_row_parts(row) for row in rows]
        n_conversations = sum(len(set(p[3])) for p in parts)
        real = [len(p[0]) for p in parts]
        width = max(1, padded_width(max(real), self.multiple, self.widths))
        ids = torch.full((len(parts), width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(parts), width), IGNORE_INDEX, dtype=torch.long)
        positions = torch.zeros((len(parts), width), dtype=torch.long)
        segments = torch.zeros((len(parts), width), dtype=torch.long)
        for r, (row_ids, row_labels, row_pos, row_seg) in enumerate(parts):
            n = len(row_ids)
            ids[r, :n] = torch.as_tensor(row_ids, dtype=torch.long)
            labels[r, :n] = torch.as_tensor(row_labels, dtype=torch.long)
            positions[r, :n] = torch.as_tensor(row_pos, dtype=torch.long)
            segments[r, :n] = torch.as_tensor(row_seg, dtype=torch.long)
            positions[r, n:] = torch.arange(width - n)  # the padding: a short sequence of its own
        mask = block_causal_mask(segments, torch.bool if self.attention == SDPA else self.mask_dtype)
        return {
            "input_ids": ids,
            "labels": labels,
            "position_ids": positions,
            "attention_mask": mask,
            "n_real_tokens": sum(real),
            "n_padded_tokens": len(parts) * width,
            "n_conversations": n_conversations,
        }

    def flat_total(self, real: int, rows: int) -> int:
        """The flat row's padded length: rows x the last width where shapes must repeat (varlen_sdpa; flash's
        own varlen keeps its exact row), else the real tokens."""
        return max(real, rows * self.widths[-1]) if self.widths and self.attention == VARLEN else real

    def _flat(self, rows) -> dict:
        # numpy over whole conversations, not Python per token: 6 ms -> under 1 ms for 16 rows of
        # 512 tokens (bench/RESULTS.md, host overhead), host time a GPU would idle through
        convs = [ex for row in rows for ex in row if len(ex["input_ids"])]
        lengths = np.fromiter((len(ex["input_ids"]) for ex in convs), dtype=np.int64, count=len(convs))
        real = int(lengths.sum())
        ids = np.fromiter(chain.from_iterable(ex["input_ids"] for ex in convs), dtype=np.int64, count=real)
        labels = np.fromiter(chain.from_iterable(ex["labels"] for ex in convs), dtype=np.int64, count=real)
        begins = np.cumsum(lengths) - lengths
        labels[begins] = IGNORE_INDEX  # a conversation's first token is no target of the one before
        positions = np.arange(real) - np.repeat(begins, lengths)
        starts = [*begins.tolist(), real]
        total = self.flat_total(real, len(rows))
        if total > real:
            ids = np.concatenate([ids, np.full(total - real, self.pad_token_id, dtype=np.int64)])
            labels = np.concatenate([labels, np.full(total - real, IGNORE_INDEX, dtype=np.int64)])
            positions = np.concatenate([positions, np.zeros(total - real, dtype=np.int64)])
        batch = {
            "input_ids": torch.from_numpy(ids)[None],
            "labels": torch.from_numpy(labels)[None],
            "position_ids": torch.from_numpy(positions)[None],
        }
        if self.attention == VARLEN:
            padded = dict(total=total, multiple=8) if self.widths else {}
            batch["varlen_index"], batch["varlen_place"] = varlen_indices(lengths, **padded)
        else:
            cu = torch.tensor(starts, dtype=torch.int32)
            longest = int(lengths.max()) if len(lengths) else 0
            batch.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
        return {
            **batch,
            "n_real_tokens": real,
            "n_padded_tokens": total,
            "n_conversations": len(convs),
        }


@dataclass
class Attention:
    kind: str  # FLASH, VARLEN, SDPA or EAGER: PackedCollator's attention argument
    why: str  # one sentence for the run's log


def _device_and_precision(model_or_device, precision: str | None):
    if isinstance(model_or_device, torch.nn.Module):
        param = next(model_or_device.parameters(), None)
        device = param.device if param is not None else torch.device("cpu")
        if precision is None and param is not None:
            precision = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(param.dtype, "fp32")
        impl = getattr(getattr(model_or_device, "config", None), "_attn_implementation", None)
        return device, precision or "fp32", impl
    return torch.device(model_or_device), precision or "fp32", None


def attention_for(model_or_device, precision: str | None = None) -> Attention:
    """Which attention keeps packed conversations apart on this model/device, and why.

    precision: the run's autocast precision (bf16/fp16/fp32); for a model it defaults to its
    parameters' dtype, which under autocast is fp32, so pass the run's precision.
    """
    device, precision, impl = _device_and_precision(model_or_device, precision)
    has_flash = importlib.util.find_spec("flash_attn") is not None
    if device.type == "cuda" and has_flash and precision in ("bf16", "fp16"):
        switch = ""
        if impl not in (None, FLASH):
            switch = f" (load or switch the model to attn_implementation='{FLASH}'; it uses {impl} now)"
        return Attention(FLASH, (
            f"packed attention: flash-attention 2 varlen ({precision} on {device}): conversations flattened "
            f"into one row with cu_seq_lens, so no mask tensor, no padding, and no work across "
            f"conversations{switch}"
        ))
    if device.type != "cuda":
        reason = f"flash-attention needs a CUDA device, this is {device.type}"
    elif not has_flash:
        reason = "the flash_attn package is not installed"
    else:
        reason = f"flash-attention runs only in bf16/fp16, this run is {precision}"
    if impl == EAGER:
        return Attention(EAGER, f"packed attention: eager with an additive block-diagonal causal mask "
                                f"({reason}; the model has no sdpa support)")
    return Attention(VARLEN, (
        f"packed attention: {VARLEN}, conversations flattened into one row and gathered side by side into "
        f"one causal sdpa (conversations x longest), so no (T x T) mask and no work across conversations "
        f"({reason}; "
        "not FlexAttention: no attention dropout, no backward on CPU; not torch's varlen_attn: CUDA "
        "bf16/fp16 only, no dropout)"
    ))


def packed_attention(device, precision: str, set_attention) -> Attention:
    """The attention that keeps packed sequences apart here (attention_for), the model switched to it by
    set_attention(kind); the masked sdpa path where the model cannot switch."""
    attention = attention_for(device, precision)
    if attention.kind in (FLASH, VARLEN):
        try:
            set_attention(attention.kind)
        except Exception as err:  # no flash/varlen support for this architecture: the masked path
            attention = Attention(SDPA, f"packed attention: sdpa with a block-diagonal causal mask ({err})")
    return attention


def pack_conversations(d, dataset, set_attention, tok, device, precision: str, max_length: int,
                       decide) -> tuple:
    """PACKING=1: the conversations packed best-fit decreasing into rows of MAX_LENGTH tokens, the collator
    that keeps them apart in attention (set_attention(kind) switches the model to the varlen kernel chosen),
    and the figures for summary.json: (rows dataset, collator, summary entries). Lowers LENGTH_GROUPING."""
    if d.length_grouping:
        d.length_grouping = False
        decide("length_grouping", 0, "PACKING=1 groups conversations by length itself")
    packing = pack(dataset.lengths, max_length)
    rows = PackedRows(dataset.examples, packing.rows)
    decide("packing", f"{len(rows)} rows", f"{len(dataset)} conversations best-fit into rows of "
           f"MAX_LENGTH={max_length}: {packing.efficiency:.1%} of the row tokens are real; "
           "BATCH_SIZE counts rows")
    attention = packed_attention(device, precision, set_attention)
    decide("attention", attention.kind, attention.why)
    multiple = 8 if device.type == "cuda" else 1
    collate = PackedCollator(tok.pad_token_id, attention=attention.kind, pad_to_multiple_of=multiple)
    return rows, collate, {"packed_rows": len(rows), "packing_efficiency": packing.efficiency,
                           "attention": attention.kind}
