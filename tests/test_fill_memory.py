"""A GPU run with no BATCH_SIZE of the user's fills the device by the memory estimate
(train/run/plan/fill.py): the real decision code on GPT-2 small and T5 small (built on the meta device:
shapes only) against a faked GPU's memory (this machine has none), and the rule that tells a launcher's
default BATCH_SIZE from the user's."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import config
from train.core.units import MIB
from train.data.chat.conversation_cache import SFTDataset
from train.models import FAMILIES
from train.models.build import build_config
from train.models.estimate import estimate_for_run
from train.models.family import CAUSAL_LM, ENCODER_DECODER
from train.run.plan import adapt, fill

CUDA = torch.device("cuda")  # a device object only: nothing here touches a GPU


def meta_model(size: str, family: str = "gpt2", vocab: int = 50304):
    hf = build_config(size, None, vocab, 0, family)
    with torch.device("meta"):
        from train.models.family import family_of

        return family_of(hf).auto_class().from_config(hf)


def conversations(n: int, longest: int) -> SFTDataset:
    rng = np.random.default_rng(0)
    lengths = [longest, *rng.integers(32, longest, n - 1)]
    return SFTDataset(
        [{"input_ids": np.zeros(k, np.int32), "labels": np.zeros(k, np.int32)} for k in lengths]
    )


def fake_gpu(monkeypatch, gb: int) -> float:
    """A GPU of `gb` GB as adapt.capacity_mb reports one (free VRAM plus what the run holds)."""
    mb = gb * 1000**3 / MIB
    monkeypatch.setattr(adapt, "capacity_mb", lambda device, cap: (mb, f"a fake {gb} GB GPU"))
    return mb


def filled(cfg, model, dataset, layout=CAUSAL_LM, max_length=1024):
    said = []
    assert fill.fill_memory(cfg, model, dataset, None, max_length, "bf16", CUDA, 1, layout,
                            lambda setting, value, why: said.append((setting, value, why)))
    return cfg.optim.batch_size, cfg.optim.gradient_accumulation_steps, dict((s, w) for s, _, w in said)


def peak(cfg, model, batch: int, accum: int, max_length: int, **shape) -> float:
    sized = config.resolve(
        None, {"mode": cfg.run.mode, "batch_size": batch, "gradient_accumulation_steps": accum}
    )
    return estimate_for_run(
        model.config, sum(p.numel() for p in model.parameters()), sized, max_length, "bf16", "cuda", **shape
    )["peak"]


@pytest.mark.parametrize(("mode", "size", "family"), [("sft", "small", "gpt2"), ("pretrain", "small", "t5")])
def test_24_and_80_gb_take_proportionate_micro_batches_and_keep_the_effective_batch(
    monkeypatch, mode, size, family
):
    model = meta_model(size, family, 32128 if family == "t5" else 50304)
    seq2seq = family == "t5"
    dataset = conversations(4000, 1024) if mode == "sft" else range(100_000)  # pretraining: windows, counted
    got = {}
    for gb in (24, 80):
        capacity = fake_gpu(monkeypatch, gb)
        cfg = config.resolve("sft" if mode == "sft" else "optimized", {"mode": mode, "batch_size": 16,
                                                                        "gradient_accumulation_steps": 16})
        batch, accum, why = filled(
            cfg, model, dataset, FAMILIES[family].layout, 1024 if mode == "sft" else 512
        )
        allowed = int(re.search(r"TARGET_VRAM=0.8 allows (\d+)", why["batch_size"]).group(1))
        got[gb] = allowed
        # as close to 256 as whole numbers allow, and said where it is not exact
        assert batch <= allowed and abs(batch * accum - 256) < accum
        assert batch * accum == 256 or "as close as whole numbers allow" in why["gradient_accumulation_steps"]
        assert f"of {capacity:,.0f} MB (a fake {gb} GB GPU)" in why["batch_size"]
        # what it allows is the largest micro-batch whose estimate is within 80 % of the memory
        shape = {"target_length": 114} if seq2seq else {}
        length = 512 if seq2seq else 1024
        # accumulation (held gradients) counted below the effective batch only, as the fill counts it
        assert peak(cfg, model, allowed, 1 if allowed >= 256 else 2, length, **shape) <= 0.8 * capacity * MIB
        assert (
            peak(cfg, model, allowed + 1, 1 if allowed + 1 >= 256 else 2, length, **shape)
            > 0.8 * capacity * MIB
        )
    assert 3 <= got[80] / got[24] <= 5, got  # 80 / 24 = 3.3, more where weights and state are a fixed cost


def test_effective_batch_is_kept_exactly_and_few_rows_are_said(monkeypatch):
    model = meta_model("small")
    fake_gpu(monkeypatch, 80)
    cfg = config.resolve("sft", {"mode": "sft", "effective_batch": 96})
    batch, accum, why = filled(cfg, model, conversations(4000, 1024))
    assert (
        batch * accum == 96 and 96 % batch == 0 and "EFFECTIVE_BATCH=96" in why["gradient_accumulation_steps"]
    )
    # short conversations: the estimate at the longest the data gives (120 tokens), not MAX_LENGTH
    cfg = config.resolve("sft", {"mode": "sft", "batch_size": 16, "gradient_accumulation_steps": 16})
    batch, accum, why = filled(cfg, model, conversations(40, 120))
    # 37 x 7 = 259, 36 x 7 = 252
    assert (batch, accum) == (37, 7) and "rows of 120 tokens" in why["batch_size"]
    assert "the data gives only 40 rows per process an epoch" in why["batch_size"]
    assert why["gradient_accumulation_steps"] == ("effective batch 256: 37 x 7 = 259 (+3), as close as whole "
                                                  "numbers allow")


def test_a_model_too_large_for_the_target_takes_one_and_says_so(monkeypatch):
    fake_gpu(monkeypatch, 1)
    cfg = config.resolve("sft", {"mode": "sft", "batch_size": 16})
    batch, accum, why = filled(cfg, meta_model("medium"), conversations(100, 1024))
    assert (batch, accum) == (1, 16) and "even 1 is over it" in why["batch_size"]


def test_a_users_batch_size_is_never_taken_for_the_launchers_default():
    def user(argv, environ=None, launcher=None, **settings):
        flags = [*argv, *(["--launcher", launcher] if launcher else [])]
        from train.config.flags import parse_training_args

        cfg = parse_training_args("sft", flags)
        for name, value in settings.items():
            setattr(cfg.optim if hasattr(cfg.optim, name) else cfg.data, name, value)
        return fill.batch_set_by_user("sft", flags, cfg, environ or {})

    assert not user([])  # the preset's 16
    # python -m train sft --batch_size 16: the user's, even at the preset's value
    assert user(["--batch_size", "16"])
    # train_sft_custom.sh passes its own default (BATCH_SIZE=${BATCH_SIZE:-16}) as a flag: not the user's ...
    assert not user(["--batch_size", "16"], launcher="train_sft_custom")
    assert not user(["--batch_size", "16"], launcher="compare-train_sft_custom")  # KIT_MADE_BY's prefix
    # ... unless the user set it: in the environment (the launchers export a first argument too) or another
    # value
    assert user(["--batch_size", "16"], {"BATCH_SIZE": "16"}, launcher="train_sft_custom")
    assert user(["--batch_size", "20"], launcher="train_sft_custom")
    assert user(["--token_budget", "4096"])  # TOKEN_BUDGET sizes the batches itself
    assert user(["--batch_size", "16"], launcher="train_sft_custom", auto_batch=True)  # find-batch measures


def test_the_launchers_export_a_micro_batch_given_as_their_first_argument():
    from pathlib import Path

    for launcher in ("train_sft_custom.sh", "train_dpo.sh"):
        text = (Path(__file__).resolve().parents[1] / launcher).read_text()
        assert "  export BATCH_SIZE=$1" in text, launcher


def test_the_command_line_asks_the_plan_to_fill_only_without_a_users_batch(tiny_flags):
    from train.cli import _ahead_of_the_run
    from train.config.flags import parse_training_args

    cfg = parse_training_args("sft", tiny_flags)
    assert isinstance(_ahead_of_the_run(cfg, print, None, fill=True), fill.Fill)
    assert _ahead_of_the_run(cfg, print, None, fill=False) is None
    assert (
        fill.applies("sft", CAUSAL_LM)
        and fill.applies("dpo", CAUSAL_LM)
        and fill.applies("grpo", CAUSAL_LM)  # its micro-batch counts prompts (tests/test_grpo_fill.py)
        and fill.applies("pretrain", ENCODER_DECODER)
    )
    # GPT-2 pretraining keeps its preset (find-batch: compute-bound)
    assert not fill.applies("pretrain", CAUSAL_LM)


def test_several_processes_size_from_the_cards_whole_memory_the_same_on_every_rank(monkeypatch):
    """Each rank plans in turn (distributed.main_first), where no collective may run: every rank reads the
    card's whole memory, so identical cards give identical micro-batches, and the effective batch counts
    every process."""
    from train.core import device as device_lib

    monkeypatch.setattr(
        device_lib, "memory_capacity", lambda device, cap: (24 * 1000**3, "this GPU (a fake)")
    )
    cfg = config.resolve("sft", {"mode": "sft", "batch_size": 16, "gradient_accumulation_steps": 16})
    said = []
    assert fill.fill_memory(
        cfg,
        meta_model("small"),
        conversations(4000, 1024),
        None,
        1024,
        "bf16",
        CUDA,
        2,
        CAUSAL_LM,
        lambda setting, value, why: said.append(why),
    )
    batch, accum = cfg.optim.batch_size, cfg.optim.gradient_accumulation_steps
    # 16 x 16 x 2 processes = 512 kept; fewer than one process's 20 (DDP takes transformers' whole-logits
    # loss)
    assert (batch, accum) == (12, 22) and abs(batch * accum * 2 - 512) < 2 * accum  # 11 x 24 with dropout 0.1
    assert "this GPU (a fake), the same on every rank" in said[0] and " x 2 processes" in said[1]


def test_through_the_launchers_a_first_argument_or_a_variable_is_the_users(tmp_path):
    """The real launchers and the real rule: KIT_PYTHON stands in for the run and says what
    batch_set_by_user makes of the command line and environment the launcher hands it."""
    import os
    import sys

    from conftest import ROOT, launch

    judge = tmp_path / "judge"
    judge.write_text(
        "#!/bin/sh\nexec " + sys.executable + " -c '\nimport os, sys\nsys.path.insert(0, sys.argv[1])\n"
        "from train.config.flags import parse_training_args\nfrom train.run.plan.fill import "
        "batch_set_by_user\n"
        "mode = sys.argv[4]; argv = sys.argv[5:]\n"
        "print(\"USER\" if batch_set_by_user(mode, argv, parse_training_args(mode, argv), os.environ) else "
        "\"DEFAULT\")\n' " + str(ROOT) + " \"$@\"\n")
    os.chmod(judge, 0o755)

    def said(script: str, *args: str, **env: str) -> str:
        result = launch(script, {"KIT_PYTHON": str(judge), **env}, *args, timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
        return result.stdout.strip().splitlines()[-1]

    assert said("train_sft_custom.sh") == "DEFAULT"  # its own BATCH_SIZE=${BATCH_SIZE:-16}: the plan fills
    assert said("train_sft_custom.sh", "16") == "USER"  # 16 given as the argument: never changed
    assert said("train_sft_custom.sh", BATCH_SIZE="16") == "USER"
    assert said("train_dpo.sh") == "DEFAULT" and said("train_dpo.sh", "8") == "USER"
    assert said("train_grpo.sh") == "DEFAULT" and said("train_grpo.sh", "8") == "USER"


def test_dry_run_shows_the_micro_batch_a_gpu_run_fills_with(monkeypatch, base_model, tmp_path, capsys):
    """DRY_RUN=1 made its plan without the fill, so on a GPU it showed the preset's micro-batch while the
    run took another. Now it shows the fill's, the one the real plan takes."""
    import json

    from tiny_tools import plan_on_a_fake_gpu

    from conftest import run_cli
    from train.config.flags import parse_training_args
    from train.run.plan.build import build

    plan_on_a_fake_gpu(monkeypatch, 24)
    data = tmp_path / "sft.jsonl"
    rows = ({"prompt": f"Say {i}.", "response": f"{i} {i}."} for i in range(200))
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    argv = ["--model_path", str(base_model), "--data_path", str(data), "--output_dir", str(tmp_path / "runs"),
            "--cache_dir", str(tmp_path / "cache"), "--max_length", "64",
            "--gradient_accumulation_steps", "4", "--max_steps", "2", "--num_workers", "0"]  # fmt: skip
    assert run_cli("sft", *argv, "--dry_run", "1") == 0
    out = capsys.readouterr().out
    batch = re.search(r"batch_size = (\d+)  \(BATCH_SIZE not set: estimated peak .* of 22,888 MB "
                      r"\(a fake 24 GB GPU, DRY_RUN: its whole memory", out)  # fmt: skip
    accum = re.search(r"gradient_accumulation_steps = (\d+)  \(effective batch 32: ", out)
    assert batch and accum, out  # was no fill at all: BATCH_SIZE 8 x GRADIENT_ACCUM 4
    assert f"= BATCH_SIZE {batch[1]} x GRADIENT_ACCUM {accum[1]} x 1 GPU" in out and int(batch[1]) > 8
    assert not (tmp_path / "runs").exists()
    plan = build(parse_training_args("sft", argv), lambda line: None, chosen=fill.Fill())  # the run's plan
    o = plan.cfg.optim
    assert (o.batch_size, o.gradient_accumulation_steps) == (int(batch[1]), int(accum[1]))


def test_dpo_leaves_room_only_for_the_reference_it_may_choose(monkeypatch):
    """REFERENCE empty is decided after the micro-batch, from the room left: the fill kept room for a frozen
    copy even where the run would take the precomputed pass (every pair read), a reference-free loss, or
    adapters. 9.3 GB: GPT-2 small at 1024 tokens takes 3 pairs without a copy, 2 with one."""
    from train.data.loader import Data
    from train.run.plan.dpo import DPOSource

    fake_gpu(monkeypatch, 9.3)
    model, pairs = meta_model("small"), range(20_000)
    data, source = Data(tokenizer=None, dataset=pairs, conversations=pairs), DPOSource()

    def filled_dpo(**settings):
        asked = {"mode": "dpo", "batch_size": 8, "gradient_accumulation_steps": 4, **settings}
        cfg = config.resolve(None, asked)
        said = {}
        assert fill.fill_memory(cfg, model, pairs, None, 1024, "bf16", CUDA, 1, CAUSAL_LM,
                                lambda setting, value, why: said.setdefault(setting, why),
                                reference_for=lambda effective: source.fill_reference(cfg, data, 1,
                                                                                      effective))
        return int(re.search(r"allows (\d+)", said["batch_size"])[1]), said["batch_size"]

    short, why = filled_dpo(max_steps=10)  # 320 of 20,000 pairs: a copy may be chosen
    assert short == 2 and "with room for REFERENCE=copy, which the run may still choose" in why
    assert filled_dpo(max_steps=10, reference="copy") == (2, why.replace(
        " with room for REFERENCE=copy, which the run may still choose (REFERENCE empty)", ""))
    for settings in ({"epochs": 2}, {"max_steps": 10, "dpo_loss": "simpo"}, {"max_steps": 10, "lora_r": 8}):
        allowed, why = filled_dpo(**settings)
        assert allowed == 3 and "room for REFERENCE" not in why, settings  # was 2: room for a copy never made
