"""torch.compile falls back to eager when it fails, with one warning, and no trace in the run.

Inductor takes minutes to compile on these 2 cores, so the working path runs dynamo with its
"eager" backend (the graph capture and guards, without code generation); the failing path
uses a backend that raises, which surfaces lazily at the first call just like a missing
Triton or an unsupported GPU.
"""

import json

import pytest
import torch

from conftest import read_jsonl, run_cli
from train.run.compile import wrapper


def broken_backend(gm, example_inputs):
    raise RuntimeError("no working Triton here\nlong traceback that must not reach the summary")


def losses(run):
    return [r["loss"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]


def test_failed_compile_trains_like_eager_and_says_so(tiny_flags, tmp_path, monkeypatch):
    argv = [*tiny_flags, "--batch_size", "4", "--max_steps", "3", "--val_fraction", "0", "--seed", "3"]
    assert run_cli("pretrain", *argv, "--run_name", "eager") == 0
    monkeypatch.setattr(wrapper, "BACKEND", broken_backend)
    assert run_cli("pretrain", *argv, "--compile", "1", "--run_name", "broken") == 0
    run = tmp_path / "runs" / "broken"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["compile"]["enabled"] is False
    assert "no working Triton here" in summary["compile_error"] and "\n" not in summary["compile_error"]
    warnings = [
        line for line in (run / "train.log").read_text().splitlines() if "torch.compile failed" in line
    ]
    assert len(warnings) == 1
    # The trial's gradients and RNG draws left no trace: the same losses, bit for bit.
    assert losses(run) == losses(tmp_path / "runs" / "eager")


def test_compile_that_works_is_used(tiny_flags, tmp_path, monkeypatch):
    sdpa_calls = []

    def recording_backend(gm, example_inputs):  # dynamo's eager backend, noting each sdpa call's arguments
        sdpa_calls.extend(dict(n.kwargs) for n in gm.graph.nodes if "scaled_dot_product" in str(n.target))
        return gm.forward

    monkeypatch.setattr(wrapper, "BACKEND", recording_backend)
    argv = [*tiny_flags, "--batch_size", "4", "--max_steps", "4", "--val_fraction", "0", "--compile", "1",
            "--log_every", "2"]  # fmt: skip
    assert run_cli("pretrain", *argv, "--run_name", "c") == 0
    summary = json.loads((tmp_path / "runs" / "c" / "summary.json").read_text())
    assert (
        summary["compile"]["enabled"] is True
        and summary["compile_error"] is None
        and summary["compile_s"] > 0
    )
    assert summary["compile"]["graph_breaks"] == 0 and summary["compile"]["recompiles"] == 0
    # the probed step (eager, under the sync counter) takes the compiled step's inputs: no look at
    # position_ids (find_packed_sequence_indices, traced away compiled) counted as two syncs a step
    assert summary["host_syncs_per_step"] == 0, summary["host_syncs"]
    assert len(losses(tmp_path / "runs" / "c")) == 2  # steps 2 and 4: step 3 is quiet, the one probed
    # pretraining's unpadded rows reach sdpa as is_causal with no mask: without the 2D mask of ones,
    # transformers' traced look for packing in position_ids made a dense (T x T) mask every step for
    # the kit's models (use_cache=False; a model with a cache skips that look, so a bare GPT2Config
    # would not show it)
    assert sdpa_calls and all(
        c.get("attn_mask") is None and c.get("is_causal") is True for c in sdpa_calls
    ), sdpa_calls


def test_a_later_compiled_failure_switches_to_eager_for_good():
    from test_train_core import tiny_model

    model = tiny_model()
    ids = torch.randint(0, 512, (2, 16))
    calls, failures = [], []

    def compiled(**kwargs):
        calls.append(1)
        if len(calls) == 2:  # a recompilation for a new shape that fails
            raise RuntimeError("recompile failed")
        return model(**kwargs)

    guarded = wrapper.GuardedModel(compiled, model, failures.append)
    expected = model(input_ids=ids, labels=ids).loss
    assert guarded(input_ids=ids, labels=ids).loss.item() == expected.item()
    assert guarded(input_ids=ids, labels=ids).loss.item() == expected.item()  # redone in eager
    guarded(input_ids=ids, labels=ids)
    assert len(calls) == 2 and [str(e) for e in failures] == ["recompile failed"]
    assert list(guarded.parameters()) == list(model.parameters())


def test_an_error_eager_shares_is_not_blamed_on_compile():
    from test_train_core import tiny_model

    model = tiny_model()
    failures = []
    guarded = wrapper.GuardedModel(lambda **kw: model(**kw), model, failures.append)
    bad = torch.full((1, 8), 10_000)  # token ids past the vocabulary
    with pytest.raises(IndexError):
        guarded(input_ids=bad)
    assert failures == [] and guarded.compiled is not None
