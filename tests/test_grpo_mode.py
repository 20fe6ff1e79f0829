"""Reward training as a mode of the kit (`python -m train grpo`), end to end on a tiny real GPT-2 made by the
tests (a pretraining run, then a 2-step SFT run: GRPO's default MODEL_PATH): TRL's metric names in
metrics.jsonl, summary.json and the generation share, final/ loadable; BETA > 0 with a frozen copy reads kl 0
at the first step; RESUME=1 from a checkpoint mid-generation (NUM_ITERATIONS=2) repeats the uninterrupted
run's steps and weights (the sampler's generator and the generation's scored completions are in the
checkpoint); LoRA with REFERENCE=adapters, accumulation, NUM_ITERATIONS=2, bf16 autocast and a
user's reward file on DATA_PATH's prompts; the refusals are one line, exit 2, no run folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_tools import add_fake_oom

from conftest import read_jsonl, run_cli

TRL_NAMES = ("reward", "reward_std", "rewards/accuracy/mean", "rewards/format/mean", "entropy",
             "completions/mean_length", "completions/clipped_ratio", "clip_ratio/region_mean",
             "frac_reward_zero_std")  # fmt: skip


@pytest.fixture(scope="module")
def sft_runs(base_model, tmp_path_factory) -> Path:
    """A root whose runs/ holds a completed SFT run (runs/sft) of the tiny pretrained GPT-2."""
    root = tmp_path_factory.mktemp("grpo")
    data = root / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "response": str(i + 1)}) + "\n"
                            for i in range(16)))  # fmt: skip
    argv = ["--model_path", str(base_model), "--data_path", str(data), "--output_dir", str(root / "runs"),
            "--cache_dir", str(root / "cache"), "--max_length", "64", "--batch_size", "4", "--max_steps", "2",
            "--run_name", "sft", "--num_workers", "0"]  # fmt: skip
    assert run_cli("sft", *argv) == 0
    return root


def grpo_argv(root: Path, name: str, *more: str, fresh: bool = True) -> list[str]:
    return [
        "grpo",
        "--output_dir",
        str(root / "runs"),
        "--cache_dir",
        str(root / "cache"),
        "--batch_size",
        "2",
        "--num_generations",
        "4",
        "--max_completion_length",
        "6",
        "--max_steps",
        "3",
        "--log_every",
        "1",
        "--learning_rate",
        "1e-4",
        "--run_name",
        name,
        *(("--overwrite", "1") if fresh else ()),
        *more,
    ]


def rows_of(run: Path) -> list[dict]:
    return [r for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]


def test_a_grpo_run_from_the_newest_sft_run_logs_trls_metrics_and_saves_a_model(sft_runs, capsys):
    assert run_cli(*grpo_argv(sft_runs, "g", "--beta", "0.04")) == 0
    out = capsys.readouterr().out
    assert f"model_path = {sft_runs / 'runs' / 'sft' / 'final'}" in out  # the default, as a decision
    assert "reference = copy" in out and "step 3/3 loss" in out and " reward " in out and "generation " in out
    run = sft_runs / "runs" / "g"
    rows = rows_of(run)
    assert len(rows) == 3 and all(
        name in row for row in rows for name in (*TRL_NAMES, "kl", "generation_frac")
    )
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # the copy is the policy before its first step
    assert all(0 < r["generation_frac"] <= 1 and r["completions/mean_length"] <= 6 for r in rows)
    assert rows[-1]["samples"] == 3 * 2  # prompts, not completions
    # tokens: what the steps trained on, 8 rows of prompt + completion (the completions' lengths, and each
    # prompt's tokens 4 times), not the loader's 2 prompts
    before = 0
    for r in rows:
        prompts = r["tokens"] - before - round(8 * r["completions/mean_length"])
        assert prompts >= 2 * 4 and prompts % 4 == 0, (r["step"], r["tokens"], before)
        before = r["tokens"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["mode"] == "grpo" and summary["reward_funcs"] == "accuracy,format"
    assert summary["num_generations"] == 4 and summary["beta"] == 0.04 and summary["reference"] == "copy"
    assert summary["final_reward"] == pytest.approx(rows[-1]["reward"])
    assert 0 < summary["generation_frac"] <= 1 and summary["generation_s"] > 0
    from transformers import AutoModelForCausalLM

    assert (
        AutoModelForCausalLM.from_pretrained(run / "final", local_files_only=True).config.model_type == "gpt2"
    )


def test_resume_mid_generation_repeats_the_uninterrupted_run(sft_runs):
    """NUM_ITERATIONS=2: steps 1-2, 3-4 and 5 are generations. The split run stops after step 3, the
    first of a generation, so the checkpoint holds its scored micro-batches (the objective's state) for
    step 4; step 5 samples anew from the restored generator."""
    same = ("--lr_schedule", "constant", "--warmup_steps", "1", "--save_every", "3", "--num_iterations", "2",
            "--learning_rate", "3e-3", "--reward_funcs", "format", "--reward_pattern", "e")  # fmt: skip
    assert run_cli(*grpo_argv(sft_runs, "whole", *same, "--max_steps", "5")) == 0
    assert run_cli(*grpo_argv(sft_runs, "split", *same, "--max_steps", "3")) == 0
    runs = sft_runs / "runs"
    state = torch.load(runs / "split" / "checkpoints" / "step-00000003" / "state.pt", weights_only=True)
    kept = state["objective"]
    assert (kept["steps"], kept["uses"], len(kept["cached"])) == (3, 1, 1)
    assert {"old_per_token_logps", "advantages", "completion_ids"} <= set(kept["cached"][0])
    resume = grpo_argv(sft_runs, "split", *same, "--max_steps", "5", "--resume", "1", fresh=False)
    assert run_cli(*resume) == 0
    whole, split = rows_of(runs / "whole"), rows_of(runs / "split")
    assert [r["step"] for r in split] == [1, 2, 3, 4, 5]
    assert whole[3]["loss"] != 0.0 and whole[3]["grad_norm"] > 0  # step 4 trains off-policy on step 3's
    for a, b in zip(whole, split, strict=True):  # the completions drawn again: the same rewards and losses
        for name in ("loss", "grad_norm", "reward", "reward_std", "completions/mean_length", "entropy",
                     "clip_ratio/region_mean"):  # fmt: skip
            assert a[name] == pytest.approx(b[name], rel=1e-5, abs=1e-6), (a["step"], name)
    one, two = (load_file(runs / name / "final" / "model.safetensors") for name in ("whole", "split"))
    assert one.keys() == two.keys()
    for key in one:
        torch.testing.assert_close(one[key], two[key], rtol=0, atol=1e-6, msg=key)


def test_lora_adapters_accumulation_iterations_bf16_and_a_users_reward_file(sft_runs, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"Say {i}.", "answer": str(i)}) + "\n" for i in range(12))
    )
    rewards = tmp_path / "my_rewards.py"
    rewards.write_text("def short(completions, answer, **kwargs):\n"
                       "    return [1.0 if a in c else -len(c) / 100 for c, a in zip(completions, answer)]\n")
    argv = grpo_argv(
        sft_runs,
        "lora",
        "--data_path",
        str(prompts),
        "--reward_funcs",
        f"{rewards}:short,format",
        "--reward_weights",
        "1,0.5",
        "--reward_pattern",
        r"\A\s*\d",
        "--lora_r",
        "4",
        "--beta",
        "0.1",
        "--gradient_accumulation_steps",
        "2",
        "--num_iterations",
        "2",
        "--precision",
        "bf16",
        "--max_steps",
        "2",
    )
    assert run_cli(*argv) == 0
    run = sft_runs / "runs" / "lora"
    rows = rows_of(run)
    assert all(f"rewards/{rewards}:short/mean" in r and "kl" in r for r in rows)
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # adapters start at 0: the base is the policy
    config = json.loads((run / "config.json").read_text())
    assert {"setting": "reference", "value": "adapters"} .items() <= next(
        d for d in config["decisions"] if d["setting"] == "reference").items()
    assert (run / "final" / "adapter").is_dir()


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ("--reference", "precomputed", "--beta", "0.1"),
            "REFERENCE=precomputed: GRPO's completions are sampled",
        ),
        (
            (
                "--reference",
                "copy",
            ),
            "REFERENCE=copy: BETA is 0",
        ),
        (("--model_size", "nano"), "MODEL_SIZE (--model_size) does not apply to reward training"),
        (("--reward_funcs", "nope"), "REWARD_FUNCS: unknown reward 'nope'"),
        (("--loss_mean", "tokens"), "LOSS_MEAN (--loss_mean) does not apply to reward training"),
        (
            ("--loss_type", "vespo", "--importance_sampling_level", "sequence"),
            "LOSS_TYPE=vespo, IMPORTANCE_SAMPLING_LEVEL=sequence: vespo weighs each completion",
        ),
    ],
)
def test_what_grpo_cannot_do_is_one_line_exit_2_and_no_run_folder(sft_runs, capsys, flags, message):
    try:
        code = run_cli(*grpo_argv(sft_runs, "refused", *flags))
    except SystemExit as stop:  # a flag's refusal stops in the parser
        code = stop.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not (sft_runs / "runs" / "refused").exists()


def test_the_memory_estimate_counts_num_generations_rows_and_sampling_s_kv_cache():
    import config
    from conftest import tiny_model
    from train.core.reward.kv_cache import kv_cache_bytes
    from train.models.estimate import estimate_for_run

    model = tiny_model()
    n = sum(p.numel() for p in model.parameters())

    def estimate(g: int) -> dict:
        cfg = config.resolve(None, {"mode": "grpo", "batch_size": 2, "num_generations": g})
        return estimate_for_run(model.config, n, cfg, 64, "fp32", "cpu")

    four, eight = estimate(4), estimate(8)
    assert (
        four["kv_cache"] == kv_cache_bytes(model.config, 2 * 4, 64)
        and eight["kv_cache"] == 2 * four["kv_cache"]
    )
    assert eight["activations"] > four["activations"]  # 16 rows in the step's forward, not 2
    sft = estimate_for_run(
        model.config, n, config.resolve(None, {"mode": "sft", "batch_size": 8}), 64, "fp32", "cpu"
    )
    assert four["activations"] == sft["activations"] and "kv_cache" not in sft


def test_the_launcher_runs_python_m_train_grpo_with_its_preset_and_refuses_a_knob_it_does_not_read():
    import shlex

    from conftest import launch

    shown = launch("train_grpo.sh", {"SHOW_COMMAND": "1", "NUM_GENERATIONS": "4", "BETA": "0.04"}, "2")
    assert shown.returncode == 0, shown.stderr
    argv = shlex.split(shown.stdout)
    at = argv.index("train")
    assert argv[at + 1 : at + 4] == ["grpo", "--preset", "grpo"]
    for flag, value in (("--batch_size", "2"), ("--num_generations", "4"), ("--beta", "0.04")):
        assert argv[argv.index(flag) + 1] == value
    refused = launch("train_grpo.sh", {"SHOW_COMMAND": "1", "DPO_LOSS": "ipo"})
    assert refused.returncode == 2 and "DPO_LOSS does not apply to reward training" in refused.stderr


def test_an_encoder_decoder_is_refused_in_one_line(sft_runs, tmp_path, capsys):
    from transformers import T5Config, T5ForConditionalGeneration

    folder = tmp_path / "t5"
    config = T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16, vocab_size=128)
    # refused from its config, before the weights load
    T5ForConditionalGeneration(config).save_pretrained(folder)
    capsys.readouterr()  # save_pretrained's progress bar
    assert run_cli(*grpo_argv(sft_runs, "t5", "--model_path", str(folder))) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "an encoder-decoder; reward training is built for causal LMs" in err
    assert not (sft_runs / "runs" / "t5").exists()


@pytest.mark.parametrize("body, said", [
    ('raise KeyError("no such column")', "raised KeyError: 'no such column' (at rewards.py:2)"),
    ("return [float('nan')] * len(completions)", "returned nan at completion 0: not a finite number"),
    ("import time; time.sleep(5)", "did not return within REWARD_TIMEOUT=0.5 s"),
])  # fmt: skip
def test_a_reward_that_raises_returns_nan_or_hangs_stops_the_run_in_one_line(
    sft_runs, tmp_path, capsys, body, said
):
    rewards = tmp_path / "rewards.py"
    rewards.write_text(f"def score(completions, **kwargs):\n    {body}\n")
    argv = grpo_argv(
        sft_runs,
        "bad-reward",
        "--reward_funcs",
        f"{rewards}:score",
        "--reward_timeout",
        "0.5",
        "--max_steps",
        "1",
        "--num_generations",
        "2",
        "--max_completion_length",
        "2",
    )
    assert run_cli(*argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"REWARD_FUNCS: reward '{rewards}:score' {said}" in err, err


def test_a_dry_run_says_the_plan_and_the_estimate_with_sampling_s_kv_cache_and_makes_no_run_folder(
    sft_runs, capsys
):
    assert run_cli(*grpo_argv(sft_runs, "dry", "--dry_run", "1", "--beta", "0.1")) == 0
    out = capsys.readouterr().out
    assert "reference = copy" in out and "sampling's KV cache" in out and "estimated peak" in out
    assert not (sft_runs / "runs" / "dry").exists()


def test_an_oom_inside_a_generation_redoes_the_step_on_the_same_completions(sft_runs, monkeypatch):
    """NUM_ITERATIONS=2: step 2 reuses step 1's 8 completions. Its forward runs out of memory (fake); the
    OOM guard halves the micro-batch, and the redone step trains on the same completions cut in two
    micro-batches, the failed attempt not counted as a use: the run equals the uninterrupted one."""
    import train.run.plan.sft as sft_plan

    real, calls, limit = sft_plan.fine_tuned_model, [], [10**9, 1]

    def fine_tuned_model(*args, **kwargs):
        model = real(*args, **kwargs)
        calls.clear()
        add_fake_oom(model, limit[0], limit[1], calls)
        return model

    monkeypatch.setattr(sft_plan, "fine_tuned_model", fine_tuned_model)
    same = ("--lr_schedule", "constant", "--warmup_steps", "1", "--num_iterations", "2", "--max_steps", "2",
            "--learning_rate", "3e-3", "--reward_funcs", "format", "--reward_pattern", "e")  # fmt: skip
    assert run_cli(*grpo_argv(sft_runs, "no-oom", *same)) == 0
    assert calls[-1] == 8  # the last forward: step 2's loss over the 8 completions step 1 drew
    limit[:] = [4, len(calls)]
    assert run_cli(*grpo_argv(sft_runs, "oom", *same)) == 0
    runs = sft_runs / "runs"
    s = json.loads((runs / "oom" / "summary.json").read_text())
    assert (s["oom_retries"], s["batch_size"], s["gradient_accumulation_steps"]) == (1, 1, 2)
    assert calls[-2:] == [4, 4]  # the redone step: two micro-batches of one prompt's 4 completions
    for a, b in zip(rows_of(runs / "no-oom"), rows_of(runs / "oom"), strict=True):
        for name in ("loss", "grad_norm", "reward", "completions/mean_length", "entropy"):
            assert a[name] == pytest.approx(b[name], rel=1e-5, abs=1e-6), (a["step"], name)
    one, two = (load_file(runs / name / "final" / "model.safetensors") for name in ("no-oom", "oom"))
    for key in one:
        torch.testing.assert_close(one[key], two[key], rtol=0, atol=1e-6, msg=key)
