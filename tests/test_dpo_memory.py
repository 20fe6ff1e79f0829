"""Preference training's memory: REFERENCE's automatic choice weighs the frozen copy's weights against
the memory left beside the run (a fake small budget through MAX_MEMORY_MB, as the fit-check tests do),
and the precomputed pass returns a new Data, the one it was given left as it was."""

from __future__ import annotations

import json

import pytest
import torch

import config
from train.core.units import MIB
from train.run.plan.dpo import copy_room, decide_reference, tightest

PAIRS = [
    {"prompt": f"Say {i}.", "chosen": f"{i} {i}.", "rejected": f"no {i % 5} way" * (1 + i % 3)}
    for i in range(24)
]


def wide_gpt2():
    """A real GPT-2 whose weights (about 7 MB in fp32) stand out against the tiny run's activations."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=256, n_head=4, n_positions=64, vocab_size=512,
                                      bos_token_id=0, eos_token_id=0))


def dpo_cfg(**overrides) -> config.TrainConfig:
    return config.resolve(None, {"mode": "dpo", "batch_size": 2, "max_length": 64, **overrides})


def choose(cfg, room, trained: int = 8, pairs: int = 40) -> tuple[str, str]:
    said = []
    kind = decide_reference(
        cfg, pairs, trained, lambda setting, value, why: said.append((setting, value, why)), room
    )
    assert said[0][:2] == ("reference", kind) and cfg.model.reference == kind
    return kind, said[0][2]


def test_a_copy_that_does_not_fit_beside_the_run_is_not_chosen():
    model, device = wide_gpt2(), torch.device("cpu")
    room = copy_room(dpo_cfg(), model, device, "fp32", 64)
    n_params = sum(p.numel() for p in model.parameters())
    # weights, gradients, AdamW state and more
    assert room["copy"] == 4 * n_params and room["run"] > room["copy"]
    # A budget with room for the run and half the copy: the short run's copy no longer fits.
    tight = int((room["run"] + room["copy"] / 2) / MIB)
    cfg = dpo_cfg(max_memory_mb=tight)
    room = copy_room(cfg, model, device, "fp32", 64)
    assert room["capacity"] == tight * MIB and room["what"] == "MAX_MEMORY_MB"
    kind, why = choose(cfg, room)
    print(why)
    assert kind == "precomputed"
    assert f"({room['copy'] / MIB:,.1f} MB) do not fit" in why and f"of {tight:,.1f} MB, MAX_MEMORY_MB" in why
    # Room for both: the short run keeps its copy, and says the figures.
    roomy = int((room["run"] + 2 * room["copy"]) / MIB)
    cfg = dpo_cfg(max_memory_mb=roomy)
    kind, why = choose(cfg, copy_room(cfg, model, device, "fp32", 64))
    print(why)
    assert kind == "copy" and "a short run reads 8 of 40 pairs" in why and "MB fit in the" in why
    # DDP: each rank measured its own device; the one with the least room decides for all.
    rooms = [copy_room(dpo_cfg(max_memory_mb=mb), model, device, "fp32", 64) for mb in (roomy, tight, None)]
    assert tightest(rooms) == rooms[1] and tightest([rooms[0], rooms[2]]) == rooms[0]
    assert choose(dpo_cfg(), tightest(rooms))[0] == "precomputed"


def test_the_earlier_reasons_hold_whatever_the_memory():
    model, device = wide_gpt2(), torch.device("cpu")
    cfg = dpo_cfg(max_memory_mb=100_000)
    room = copy_room(cfg, model, device, "fp32", 64)
    assert choose(cfg, room, trained=40)[0] == "precomputed"  # reads every pair: the pass is cheaper
    assert choose(dpo_cfg(lora_r=4), room)[0] == "adapters"
    assert choose(dpo_cfg(), None)[0] == "copy"  # memory unknown: as before
    asked = dpo_cfg(reference="copy", max_memory_mb=1)
    assert (
        decide_reference(asked, 40, 8, lambda *a: pytest.fail("an asked REFERENCE is no decision"), room)
        == "copy"
    )
    assert decide_reference(dpo_cfg(dpo_loss="simpo"), 40, 8, lambda *a: None, room) is None


def test_a_dpo_run_on_a_tight_budget_precomputes_and_leaves_its_data_alone(
    base_model, tmp_path, capsys, monkeypatch
):
    """End to end: MAX_MEMORY_MB below the estimate (the run warns, not refuses) and a short run that
    would take a copy: the plan chooses precomputed, says the figures, and trains; the precomputed
    pass's Data is a new one (the source's Data keeps its plain collator)."""
    from conftest import run_cli
    from train.run.plan import dpo_reference

    made = []
    real = dpo_reference.with_precomputed

    def spy(data, *args):
        new = real(data, *args)
        made.append((data, new))
        return new

    monkeypatch.setattr(dpo_reference, "with_precomputed", spy)  # a spy only: the real function runs
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    argv = [
        "dpo",
        "--model_path",
        str(base_model),
        "--data_path",
        str(tmp_path / "pairs.jsonl"),
        "--output_dir",
        str(tmp_path / "runs"),
        "--cache_dir",
        str(tmp_path / "cache"),
        "--max_length",
        "64",
        "--batch_size",
        "2",
        "--max_steps",
        "2",
        "--num_workers",
        "0",
        "--run_name",
        "tight",
        "--max_memory_mb",
        "1",
    ]
    assert run_cli(*argv) == 0
    out = capsys.readouterr().out
    assert "reference = precomputed" in out and "do not fit beside the run" in out
    (given, new), = made
    assert (
        new is not given
        and new.collate is not given.collate
        and type(given.collate).__name__ != "WithReference"
    )
    assert "reference" not in given.summary
    summary = json.loads((tmp_path / "runs" / "tight" / "summary.json").read_text())
    assert summary["reference"] == "precomputed"


# ---- measured: what each REFERENCE keeps in memory --------------------------------------------------


def weighty_model(base_model, folder):
    """A GPT-2 of about 19M parameters (6 layers, width 512, fp32: ~73 MB of weights) with the tiny
    base model's tokenizer, saved as a MODEL_PATH: its weights dominate a short run's other memory."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tok = AutoTokenizer.from_pretrained(base_model, local_files_only=True)
    vocab = json.loads((base_model / "config.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(
            n_layer=6,
            n_embd=512,
            n_head=8,
            n_positions=64,
            vocab_size=vocab,
            bos_token_id=tok.eos_token_id,
            eos_token_id=tok.eos_token_id,
        )
    )
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters()) * 4


def peak_rss_mb(runs: dict[str, list[str]], folder) -> dict[str, float]:
    """{name: the peak resident set its `python -m train` run reports (summary.json's
    host_memory.peak_rss_mb, read at each log point: what the run keeps while it trains)}, the runs
    side by side (one thread each), each a fork of the tests' warm server (train_python()), so each
    starts from the same imports: the differences are the runs' own."""
    import subprocess

    from conftest import ROOT, launcher_env, train_python

    env = {**launcher_env({}), "OMP_NUM_THREADS": "1"}
    procs = {}
    for name, argv in runs.items():
        log = open(folder / f"{name}.txt", "wb")  # noqa: SIM115 (closed below, once the process ends)
        procs[name] = (subprocess.Popen([train_python(), "-m", "train", *argv], cwd=ROOT, env=env, stdout=log,
                                        stderr=subprocess.STDOUT), log)  # fmt: skip
    peaks = {}
    for name, (proc, log) in procs.items():
        proc.wait()
        log.close()
        assert proc.returncode == 0, (folder / f"{name}.txt").read_text()[-3000:]
        summary = json.loads((folder / "runs" / name / "summary.json").read_text())
        peaks[name] = summary["host_memory"]["peak_rss_mb"]
    return peaks


def test_precomputed_and_adapters_hold_about_one_set_of_weights_less_than_a_copy(base_model, tmp_path):
    """Peak RSS of a 2-step dpo run (fp32, MAX_LENGTH 32, 2 pairs a step) of a ~25M-parameter GPT-2,
    each REFERENCE in its own process: a copy keeps a second set of weights, precomputed and
    adapters none. Full fine-tuning compares copy with precomputed; LoRA (its base frozen) compares
    copy with adapters. The differences are measured against the weights' bytes (docs/dpo.md). Slow
    for a unit test (integration, as conftest marks it): four whole runs side by side; their memory,
    not their time, is what it reads."""
    weights = weighty_model(base_model, tmp_path / "model") / MIB
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PAIRS[:12]))
    common = [
        "dpo",
        "--model_path",
        str(tmp_path / "model"),
        "--data_path",
        str(tmp_path / "pairs.jsonl"),
        "--output_dir",
        str(tmp_path / "runs"),
        "--max_length",
        "32",
        "--batch_size",
        "2",
        "--max_steps",
        "2",
        "--num_workers",
        "0",
        "--precision",
        "fp32",
        "--eval_batches",
        "1",
        "--save_every",
        "0",
        "--log_every",
        "1",
    ]
    ways = {
        "copy": ["--reference", "copy"],
        "precomputed": ["--reference", "precomputed"],
        "lora-copy": ["--reference", "copy", "--lora_r", "4"],
        "adapters": ["--reference", "adapters", "--lora_r", "4"],
    }
    # each its own cache: two processes never write one preference cache at once
    peaks = peak_rss_mb(
        {
            name: [*common, *more, "--run_name", name, "--cache_dir", str(tmp_path / f"cache-{name}")]
            for name, more in ways.items()
        },
        tmp_path,
    )
    saved = {
        "precomputed": peaks["copy"] - peaks["precomputed"],
        "adapters": peaks["lora-copy"] - peaks["adapters"],
    }
    print(
        f"weights {weights:.0f} MB; peak RSS "
        + ", ".join(f"{k} {v:.0f} MB" for k, v in peaks.items())
        + "; below the copy: "
        + ", ".join(f"{k} {v:.0f} MB ({v / weights:.0%} of the weights)" for k, v in saved.items())
    )
    for way, mb in saved.items():
        assert 0.4 * weights <= mb <= 1.6 * weights, (way, mb, weights, peaks)
