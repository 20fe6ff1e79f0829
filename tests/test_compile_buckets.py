"""COMPILE=1 stays compiled: SFT (plain), packed SFT, T5 SFT and T5 pretraining each compile one
graph (the length buckets' lengths dynamic from the first call), with no graph break and no
recompile, evaluation adds none, and a step takes no host sync; the counts are the ones a real
run writes to summary.json (dynamo's own counters, the run's sync probe). Bucketed padding is
masked: the loss and gradients of a bucketed batch, and of a packed row padded to rows x
MAX_LENGTH, equal the unpadded ones.

The runs use dynamo's "eager" backend (plain SFT: "aot_eager", whose backward is traced with the
same symbolic lengths inductor gets): graphs, guards and recompiles are dynamo's and do not
depend on the code generator, which on these 2 cores (inductor) would take minutes.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_t5_sft import t5_folder  # noqa: F401 (the tiny T5 SFT starts from)

from conftest import run_cli, tiny_model
from train.core.attention import use_attention, varlen_indices
from train.core.step import forward_loss
from train.data.chat.batching import PadCollator, length_buckets
from train.data.chat.packing import VARLEN, PackedCollator
from train.models.family import CAUSAL_LM
from train.run.compile import wrapper

# Lengths from a few tokens to past MAX_LENGTH=64 (truncated): many widths without buckets.
RECORDS = [{"prompt": f"Item {i}.", "response": "fox " * (1 + (i * 7) % 45)} for i in range(240)]
BUCKETS = length_buckets(64)


def write_data(tmp_path) -> str:
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return str(path)


def compiled_run(tmp_path, monkeypatch, *argv, backend: str = "eager") -> dict:
    monkeypatch.setattr(wrapper, "BACKEND", backend)
    assert run_cli(*argv, "--output_dir", str(tmp_path / "runs"), "--compile", "1", "--run_name", "c",
                   "--num_workers", "0", "--log_every", "20") == 0
    summary = json.loads((tmp_path / "runs" / "c" / "summary.json").read_text())
    assert summary["compile"]["enabled"] is True, summary["compile_error"]
    assert summary["host_syncs_per_step"] == 0, summary["host_syncs"]
    return summary


ONE_GRAPH = {
    "enabled": True,
    "mode": "default",
    "graph_breaks": 0,
    "recompiles": 0,
    "graphs": 1,
    "cuda_graphs": None,
    "cudagraph_skips": None,
}


def test_bucket_widths():
    assert BUCKETS == (8, 16, 24, 32, 48, 64)
    wide = length_buckets(1024)
    assert len(wide) == 8 and wide[-1] == 1024 and all(w % 8 == 0 for w in wide)
    assert all(b <= 1.5 * a + 8 for a, b in zip(wide, wide[1:], strict=False))


def test_plain_sft_is_one_graph_over_every_bucket_and_eval_adds_nothing(base_model, tmp_path, monkeypatch):
    data, widths = write_data(tmp_path), set()
    pad = PadCollator.__call__

    def recorded(self, examples):  # the widths the run's training batches took (validation's run eager)
        batch = pad(self, examples)
        if self.widths:
            widths.add(batch["input_ids"].shape[1])
        return batch

    monkeypatch.setattr(PadCollator, "__call__", recorded)
    s = compiled_run(tmp_path, monkeypatch, "sft", "--model_path", str(base_model), "--data_path", data,
                     "--max_length", "64", "--batch_size", "2", "--max_steps", "40", "--length_grouping", "0",
                     "--eval_every", "15", "--val_fraction", "0.1", backend="aot_eager")
    print("compile", s["compile"])
    assert s["compile"] == ONE_GRAPH and s["eval_passes"] >= 3, s["compile"]
    log = (tmp_path / "runs" / "c" / "train.log").read_text()
    assert f"length_buckets = {','.join(map(str, BUCKETS))}" in log
    # the one graph served batches of several widths (a static graph per width would be as many)
    assert len(widths) >= 4 and widths <= set(BUCKETS), widths


def test_packed_sft_is_one_graph(base_model, tmp_path, monkeypatch):
    s = compiled_run(tmp_path, monkeypatch, "sft", "--model_path", str(base_model), "--data_path",
                     write_data(tmp_path), "--max_length", "64", "--batch_size", "2", "--max_steps", "12",
                     "--packing", "1", "--val_fraction", "0")
    assert s["attention"] == VARLEN
    assert s["compile"] == ONE_GRAPH, s["compile"]


def test_t5_sft_is_one_graph_over_both_sides_buckets(t5_folder, tmp_path, monkeypatch):  # noqa: F811
    s = compiled_run(tmp_path, monkeypatch, "sft", "--model_path", str(t5_folder), "--data_path",
                     write_data(tmp_path), "--cache_dir", str(tmp_path / "cache"), "--tokenize_workers", "1",
                     "--max_length", "64", "--batch_size", "4", "--max_steps", "16", "--length_grouping", "0",
                     "--eval_every", "6", "--val_fraction", "0.1")
    print("compile", s["compile"])
    assert s["compile"] == ONE_GRAPH and s["eval_passes"] >= 3, s["compile"]


def test_t5_pretraining_is_one_graph(tiny_flags, tmp_path, monkeypatch):
    t5 = tmp_path / "t5"
    t5.mkdir()
    (t5 / "config.json").write_text(
        json.dumps(
            {
                "model_type": "t5",
                "d_model": 32,
                "d_ff": 64,
                "num_layers": 1,
                "num_decoder_layers": 1,
                "num_heads": 2,
                "d_kv": 16,
                "n_positions": 512,
                "dropout_rate": 0.0,
                "feed_forward_proj": "relu",
            }
        )
    )
    flags = [f for f in tiny_flags if f not in ("--output_dir", str(tmp_path / "runs"))]
    at = flags.index("--model_config")
    flags[at + 1] = str(t5)
    s = compiled_run(tmp_path, monkeypatch, "pretrain", *flags, "--max_length", "32", "--batch_size", "4",
                     "--max_steps", "20", "--eval_every", "10")
    # every span-corrupted window has the same source and target length: one shape, no buckets
    assert s["compile"] == ONE_GRAPH, s["compile"]
    assert s["eval_passes"] >= 2


def batch_loss_and_grads(model, batch) -> tuple[float, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = forward_loss(model, batch, torch.device("cpu"), "fp32", layout=CAUSAL_LM)
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]


def examples(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(1, 500, (n,), generator=g).tolist()
        out.append({"input_ids": ids, "labels": [-100] * (n // 3) + ids[n // 3 :]})
    return out


def test_bucketed_padding_leaves_loss_and_gradients_alone():
    model = tiny_model()
    batch = examples([5, 11, 19])
    exact, bucketed = PadCollator(0), PadCollator(0)
    bucketed.widths = BUCKETS
    a, b = exact(batch), bucketed(batch)
    assert a["input_ids"].shape[1] == 19 and b["input_ids"].shape[1] == 24
    loss_a, grads_a = batch_loss_and_grads(model, a)
    loss_b, grads_b = batch_loss_and_grads(model, b)
    assert loss_b == pytest.approx(loss_a, rel=1e-6)
    for ga, gb in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(gb, ga, rtol=1e-5, atol=1e-7)


def test_packed_row_padded_to_max_length_changes_nothing():
    model = tiny_model()
    use_attention(model, VARLEN)
    rows = [examples([7, 13, 4], 1), examples([21, 9], 2)]
    exact, bucketed = PackedCollator(0, attention=VARLEN), PackedCollator(0, attention=VARLEN)
    bucketed.widths = BUCKETS
    a, b = exact(rows), bucketed(rows)
    assert a["input_ids"].shape == (1, 54) and b["input_ids"].shape == (1, 2 * 64)
    assert (b["labels"][0, 54:] == -100).all() and b["n_real_tokens"] == 54 and b["n_padded_tokens"] == 128
    assert b["varlen_index"].shape == (5, 24)  # conversations x longest (21) rounded up to 8
    loss_a, grads_a = batch_loss_and_grads(model, a)
    loss_b, grads_b = batch_loss_and_grads(model, b)
    assert loss_b == pytest.approx(loss_a, rel=1e-6)
    for ga, gb in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(gb, ga, rtol=1e-5, atol=1e-7)


def test_varlen_indices_never_size_one():
    index, place = varlen_indices([3], total=6, multiple=8)
    assert index.shape == (2, 8) and place.tolist() == [0, 1, 2, 0, 0, 0]


def test_compiled_masks_pretraining_causal_and_sft_padding_without_recompiles():
    """The kit's model (use_cache=False), compiled: a batch with no mask (pretraining's windows)
    reaches sdpa with no mask and is_causal; batches that carry one (SFT) keep the traced mask, so
    a padded and an unpadded batch of one width share a graph (a host answer would recompile)."""
    calls, graphs = [], []

    def backend(gm, example_inputs):
        graphs.append(gm)
        calls.append([dict(n.kwargs) for n in gm.graph.nodes if "scaled_dot_product" in str(n.target)])
        return gm.forward

    torch._dynamo.reset()
    model = tiny_model()
    assert model.config.use_cache is False  # with a cache transformers skips its look for packing
    compiled = torch.compile(model, backend=backend)
    ids = torch.randint(1, 500, (2, 16))
    forward_loss(compiled, {"input_ids": ids}, torch.device("cpu"), "fp32", layout=CAUSAL_LM).backward()
    assert len(graphs) == 1 and calls[0] and all(c.get("attn_mask") is None and c.get("is_causal") is True
                                                  for c in calls[0]), calls  # fmt: skip
    torch._dynamo.reset()
    graphs.clear()
    calls.clear()
    padded = torch.ones_like(ids)
    padded[1, 12:] = 0
    labels = ids.masked_fill(padded == 0, -100)  # the same targets: num_items_in_batch alone would recompile
    for mask in (padded, torch.ones_like(ids), padded):
        batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
        forward_loss(compiled, batch, torch.device("cpu"), "fp32", layout=CAUSAL_LM).backward()
    assert len(graphs) == 1, f"{len(graphs)} graphs for one width"
    assert all(c.get("attn_mask") is not None for c in calls[0]), calls
    torch._dynamo.reset()
