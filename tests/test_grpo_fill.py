"""GRPO fills the GPU by itself (train/run/plan/fill.py) as SFT, DPO and T5 do: with no BATCH_SIZE of the
user's, the most prompts a micro-batch whose estimated peak (NUM_GENERATIONS rows a prompt at the longest
prompt + MAX_COMPLETION_LENGTH, sampling's KV cache, the reference copy BETA > 0 takes) is within
TARGET_VRAM, the effective batch of prompts kept by accumulation. The real decision code on GPT-2 small
(the meta device: shapes only) and on a tiny real model's plan and dry run, against a faked GPU's memory
(this machine has none)."""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest
import torch

import config
from conftest import run_cli
from train.core.units import MIB
from train.data.prompt.prompt_batches import PromptDataset
from train.models.build import build_config
from train.models.estimate import estimate_for_run
from train.models.family import CAUSAL_LM, family_of
from train.run.plan import fill

CUDA = torch.device("cuda")  # a device object only: nothing here touches a GPU


def small_gpt2():
    hf = build_config("small", None, 50304, 0, "gpt2")
    with torch.device("meta"):
        return family_of(hf).auto_class().from_config(hf)


def prompts(n: int, longest: int, room: int) -> PromptDataset:
    rng = np.random.default_rng(0)
    return PromptDataset([[0] * int(k) for k in [longest, *rng.integers(8, longest, n - 1)]], room)


def grpo_cfg(**settings):
    asked = {"mode": "grpo", "batch_size": 4, "gradient_accumulation_steps": 64, "max_completion_length": 256}
    return config.resolve("grpo", {**asked, **settings})


def filled(cfg, model, dataset, gb: float, reference_for=None) -> tuple[int, int, int, dict]:
    """(micro-batch, accumulation, what the memory allows, the decisions' reasons) on a fake `gb` GB GPU."""
    said = {}
    capacity = (gb * 1000**3 / MIB, f"a fake {gb:g} GB GPU")
    assert fill.fill_memory(cfg, model, dataset, None, 1024, "bf16", CUDA, 1, CAUSAL_LM,
                            lambda setting, value, why: said.setdefault(setting, why), capacity=capacity,
                            reference_for=reference_for)  # fmt: skip
    allowed = int(re.search(r"TARGET_VRAM=0.8 allows (\d+)", said["batch_size"])[1])
    return cfg.optim.batch_size, cfg.optim.gradient_accumulation_steps, allowed, said


def peak(cfg, model, batch: int, per_rank: int, length: int) -> float:
    """The estimate at `batch` prompts as the fill asks it (held gradients below the effective batch)."""
    sized = copy.deepcopy(cfg)
    sized.optim.batch_size, sized.optim.gradient_accumulation_steps = batch, 1 if batch >= per_rank else 2
    n = sum(p.numel() for p in model.parameters())
    return estimate_for_run(model.config, n, sized, length, "bf16", "cuda")["peak"]


def test_a_bigger_card_takes_more_prompts_sized_at_the_longest_prompt_and_its_completion():
    model, data = small_gpt2(), prompts(4000, 100, 256)
    got = {}
    for gb in (24, 80):
        cfg = grpo_cfg()
        batch, accum, allowed, why = filled(cfg, model, data, gb)
        got[gb] = allowed
        assert batch <= allowed and abs(batch * accum - 256) < accum  # 256 prompts a step, as near as can be
        assert batch * accum == 256 or "as close as whole numbers allow" in why["gradient_accumulation_steps"]
        assert ("prompts, 8 rows each of 356 tokens: the longest prompt 100 + MAX_COMPLETION_LENGTH 256"
                in why["batch_size"]), why  # fmt: skip
        # the largest whose estimate at 100 + 256 tokens is within 80 % of the card (not at MAX_LENGTH 1024)
        limit = 0.8 * gb * 1000**3
        assert peak(cfg, model, allowed, 256, 356) <= limit < peak(cfg, model, allowed + 1, 256, 356)
        assert peak(cfg, model, allowed, 256, 1024) > limit
    assert got[24] < 256 and 3 <= got[80] / got[24] <= 5, got  # 80 / 24 = 3.3, more: weights are fixed


def test_more_generations_or_longer_completions_take_fewer_prompts():
    model = small_gpt2()
    base = filled(grpo_cfg(), model, prompts(4000, 100, 256), 80)[2]
    sixteen = filled(grpo_cfg(num_generations=16), model, prompts(4000, 100, 256), 80)
    longer = filled(grpo_cfg(max_completion_length=768), model, prompts(4000, 100, 768), 80)
    assert sixteen[2] < base and longer[2] < base, (base, sixteen[2], longer[2])
    assert "16 rows each of 356 tokens" in sixteen[3]["batch_size"]
    assert "8 rows each of 868 tokens" in longer[3]["batch_size"]
    for batch, accum, _, _ in (sixteen, longer):
        assert abs(batch * accum - 256) < accum


def test_beta_leaves_room_for_the_frozen_copy_grpo_takes_and_not_for_adapters():
    """REFERENCE empty is decided after the micro-batch (GRPOSource.objective): BETA > 0 takes a frozen copy,
    so the fill leaves room for it; with LORA_R the reference is the adapters switched off: no room. 12 GB:
    GPT-2 small takes 3 prompts without a copy, 2 with one."""
    from train.data.loader import Data
    from train.run.plan.grpo import GRPOSource

    model, data = small_gpt2(), prompts(4000, 100, 256)
    source = GRPOSource()

    def allowed(**settings) -> tuple[int, str]:
        cfg = grpo_cfg(**settings)
        door = Data(tokenizer=None, dataset=data)
        _, _, most, why = filled(cfg, model, data, 12, lambda effective: source.fill_reference(cfg, door, 1,
                                                                                                effective))
        return most, why["batch_size"]

    none, _ = allowed()
    copied, why = allowed(beta=0.04)
    assert (none, copied) == (3, 2) and "with room for REFERENCE=copy" in why
    assert allowed(beta=0.04, reference="copy")[0] == copied  # set: the estimate's own
    assert allowed(beta=0.04, lora_r=8) == (none, allowed()[1])  # adapters: no copy, no room


# ---- a tiny real model's plan and dry run (the built-in arithmetic prompts: 35 tokens, 29 completion) ----


def grpo_argv(base_model, tmp_path, *more: str) -> list[str]:
    return ["--model_path", str(base_model), "--output_dir", str(tmp_path / "runs"), "--cache_dir",
            str(tmp_path / "cache"), "--gradient_accumulation_steps", "16", "--max_steps", "2",
            *more]  # fmt: skip


def plan_of(base_model, tmp_path, *more: str):
    """The plan a GRPO run makes with no BATCH_SIZE of the user's (fill.Fill)."""
    from train.config.flags import parse_training_args
    from train.run.plan.build import build

    return build(parse_training_args("grpo", grpo_argv(base_model, tmp_path, *more)), lambda line: None,
                 chosen=fill.Fill())  # fmt: skip


@pytest.fixture
def planned(monkeypatch, base_model, tmp_path):
    """(micro-batch, accumulation) of that plan on a fake GPU of `gb` GB."""
    from tiny_tools import plan_on_a_fake_gpu

    def plan(gb: float, *more: str):
        plan_on_a_fake_gpu(monkeypatch, gb)
        o = plan_of(base_model, tmp_path, *more).cfg.optim
        return o.batch_size, o.gradient_accumulation_steps

    return plan


def test_on_a_cpu_nothing_is_filled_and_compiles_widest_bucket_is_the_row_sized(base_model, tmp_path):
    """The fill runs on a GPU only: a CPU plan keeps 8 x 16. COMPILE pads the loss's rows to length buckets
    made from the longest prompt + MAX_COMPLETION_LENGTH (GRPOSource.objective): the widest is the row the
    fill sizes at (adapt.row_shape)."""
    from train.run.plan.adapt import row_shape

    plan = plan_of(base_model, tmp_path, "--compile", "1")
    assert (plan.cfg.optim.batch_size, plan.cfg.optim.gradient_accumulation_steps) == (8, 16)
    decided = {d["setting"]: d["value"] for d in plan.decisions}
    assert "batch_size" not in decided
    shape = row_shape(plan.dataset, plan.collate, plan.max_length, "grpo", plan.family.layout)
    assert shape == {"max_length": 64, "prompt_length": 35, "completion_length": 29}
    assert max(int(w) for w in decided["length_buckets"].split(",")) == shape["max_length"]


def test_a_grpo_dry_run_shows_the_fills_micro_batch_and_keeps_a_users(monkeypatch, base_model, tmp_path,
                                                                        capsys, planned):
    from tiny_tools import plan_on_a_fake_gpu

    from conftest import run_cli

    plan_on_a_fake_gpu(monkeypatch, 0.4)
    assert run_cli("grpo", *grpo_argv(base_model, tmp_path), "--dry_run", "1") == 0
    out = capsys.readouterr().out
    batch = re.search(r"batch_size = (\d+)  \(BATCH_SIZE not set: estimated peak [\d,]+ MB at \d+ "
                      r"\(prompts, 8 rows each of 64 tokens: the longest prompt 35 \+ "
                      r"MAX_COMPLETION_LENGTH 29\) = \d+% of 381 MB \(a fake 0.4 GB GPU, DRY_RUN: its whole "
                      r"memory", out)  # fmt: skip
    accum = re.search(r"gradient_accumulation_steps = (\d+)  \(effective batch 128: ", out)
    assert batch and accum, out  # was no fill for GRPO: BATCH_SIZE 8 x GRADIENT_ACCUM 16
    b, a = int(batch[1]), int(accum[1])
    assert f"= BATCH_SIZE {b} x GRADIENT_ACCUM {a} x 1 GPU" in out and 8 < b < 128 and abs(b * a - 128) < a
    assert not (tmp_path / "runs").exists()
    assert planned(0.4) == (b, a)  # the run's plan takes what the dry run showed
    # a bigger card more prompts; more rows a prompt, or longer ones, fewer
    assert planned(0.8)[0] > b and planned(0.4, "--num_generations", "16")[0] < b
    assert planned(0.4, "--max_completion_length", "8")[0] > b
    # BATCH_SIZE of the user's: kept, no fill
    assert run_cli("grpo", *grpo_argv(base_model, tmp_path), "--batch_size", "3", "--dry_run", "1") == 0
    out = capsys.readouterr().out
    assert "BATCH_SIZE not set" not in out and "= BATCH_SIZE 3 x GRADIENT_ACCUM 16 x 1 GPU" in out


def test_find_batch_reuses_an_answer_only_for_the_same_rows_a_prompt():
    """AUTO_BATCH=1 reuses find-batch's saved answer for the same settings: a GRPO answer measured at 8
    completions of 64 tokens is not one for 16, nor for longer completions."""
    from types import SimpleNamespace

    from conftest import tiny_model
    from train.run.plan.batch_answer import settings_key

    model = tiny_model()

    def key(mode="grpo", **settings):
        cfg = config.resolve(None, {"mode": mode, "max_completion_length": 29, **settings})
        plan = SimpleNamespace(model=model, cfg=cfg, max_length=64, precision="fp32",
                               device=torch.device("cpu"))
        return settings_key(plan, 8, 1)

    assert key() == key() and key() != key(num_generations=16) and key() != key(max_completion_length=8)
    assert "rows" not in key("sft")  # the other modes' keys as they were


@pytest.mark.parametrize("tool", ["doctor", "autotune"])
def test_a_tool_not_built_for_grpo_says_so_in_one_line(tool, capsys):
    assert run_cli(tool, "grpo", "--max_steps", "2") == 2
    err = capsys.readouterr().err
    assert err.strip() == f"error: {tool} grpo: {tool} is not built for grpo; it takes pretrain, sft, dpo"
