"""Host overhead (issue 26, A4): the packed collator's flat row, now built with numpy over whole
conversations instead of Python per token, is exactly the per-token construction (ids, labels with
each conversation's first token ignored, restarting positions, varlen indices, cu_seq_lens), empty
conversations included; and the host-overhead bench refuses an unknown path in one line."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from train.core.attention import varlen_indices
from train.core.units import IGNORE_INDEX
from train.data.chat.packing import PackedCollator


def rows_of(seed: int) -> list[list[dict]]:
    rng = random.Random(seed)

    def conv(n):
        ids = [rng.randrange(8192) for _ in range(n)]
        return {"input_ids": ids, "labels": [t if k > n // 3 else IGNORE_INDEX for k, t in enumerate(ids)]}

    return [
        [conv(rng.choice([0, 1, rng.randint(2, 90)])) for _ in range(rng.randint(1, 5))] for _ in range(7)
    ]


def per_token(rows):
    ids, labels, positions, lengths = [], [], [], []
    for ex in (ex for row in rows for ex in row if ex["input_ids"]):
        n = len(ex["input_ids"])
        ids += ex["input_ids"]
        labels += [IGNORE_INDEX, *ex["labels"][1:]]
        positions += range(n)
        lengths.append(n)
    return ids, labels, positions, lengths


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_flat_row_equals_the_per_token_construction(seed):
    rows = rows_of(seed)
    ids, labels, positions, lengths = per_token(rows)
    got = PackedCollator(0, attention="varlen_sdpa")(rows)
    assert got["input_ids"].tolist() == [ids] and got["labels"].tolist() == [labels]
    assert got["position_ids"].tolist() == [positions] and got["input_ids"].dtype == torch.long
    index, place = varlen_indices(lengths)
    assert torch.equal(got["varlen_index"], index) and torch.equal(got["varlen_place"], place)
    assert got["n_real_tokens"] == got["n_padded_tokens"] == len(ids) and got["n_conversations"] == len(
        lengths
    )
    flash = PackedCollator(0, attention="flash_attention_2")(rows)
    starts = [sum(lengths[:k]) for k in range(len(lengths) + 1)]
    assert flash["cu_seq_lens_q"].tolist() == starts and flash["cu_seq_lens_q"].dtype == torch.int32
    assert flash["max_length_q"] == max(lengths) and type(flash["max_length_q"]) is int


def test_bench_refuses_an_unknown_path_in_one_line():
    proc = subprocess.run([sys.executable, "bench/host_overhead.py", "--paths", "sft_fast"], cwd=ROOT,
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: --paths: unknown sft_fast (known: pretrain, sft_plain, sft_grouped, sft_packed, "
        "sft_token_budget, "
        "t5_pretrain, t5_sft)"
    ], proc.stderr
