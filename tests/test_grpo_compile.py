"""COMPILE for reward training: the loss's forwards (the policy loss and NUM_ITERATIONS > 1's old
log-probs) run through the compiled model, the sampler through the eager one with the same weights. The
completions pad to the length buckets (logps.widen), which leaves the loss and its gradient as they were;
a compiled run is one graph per grad mode over several widths, with no graph break and no recompile after
the trial step (dynamo's own counters, as summary.json writes them), and its losses equal the eager run's;
LoRA with REFERENCE=adapters and BETA > 0 with REFERENCE=copy (both references eager) train compiled too.
COMPILE empty stays off on a CPU and on on a GPU (decisions).

The runs use dynamo's "aot_eager" backend (the backward traced with the same symbolic lengths inductor
gets; LoRA's run "eager", dynamo's graphs alone): graphs, guards and recompiles are dynamo's and do not
depend on the code generator, which on these 2 cores (inductor) would take minutes."""

from __future__ import annotations

import json

import pytest
import torch
from grpo_tools import PAD, tiny
from test_grpo_mode import grpo_argv, rows_of, sft_runs  # noqa: F401 (the SFT run GRPO starts from)

from config import resolve
from conftest import run_cli
from train.core.reward import GrpoKnobs, grpo_loss, model_inputs
from train.core.reward.logps import widen
from train.models import FAMILIES
from train.run.compile import wrapper
from train.run.compile.choose import step_math_ms

CPU = torch.device("cpu")
# Prompts from 3 to about 20 tokens: with up to 6 completion tokens their rows fall into several buckets.
PROMPTS = [{"prompt": "Say " + " ".join(["seven"] * (i % 9)) + f" {i}.", "answer": str(i)} for i in range(24)]
# Per step, the compiled run against the eager one: the tolerance tests/test_dpo_distributed.py's
# compiled-vs-eager run uses.
TOLERANCE = dict(rel=1e-5, abs=1e-5)


def batch_of(rows: int = 6, seed: int = 0) -> dict:
    """A scored batch in TRL's layout: prompts left-padded (2 to 6 tokens), completions right-padded."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, 90, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
               for _ in range(rows)]  # fmt: skip
    lengths = [int(torch.randint(1, 6, (1,), generator=g)) for _ in range(rows)]
    wp, wc = max(map(len, prompts)), max(lengths)
    return {
        "prompt_ids": torch.tensor([[PAD] * (wp - len(p)) + p for p in prompts]),
        "prompt_mask": torch.tensor([[0] * (wp - len(p)) + [1] * len(p) for p in prompts]),
        "completion_ids": torch.tensor([torch.randint(2, 90, (n,), generator=g).tolist() + [PAD] * (wc - n)
                                        for n in lengths]),  # fmt: skip
        "completion_mask": torch.tensor([[1] * n + [0] * (wc - n) for n in lengths]),
        "advantages": torch.randn(rows, generator=g),
        "old_per_token_logps": -torch.rand(rows, wc, generator=g),
        "ref_per_token_logps": -torch.rand(rows, wc, generator=g),
    }


def loss_and_grads(model, batch: dict, knobs: GrpoKnobs):
    model.zero_grad(set_to_none=True)
    loss, metrics = grpo_loss(model, batch, CPU, "fp32", knobs=knobs)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    return loss.item(), {k: float(v) for k, v in metrics.items()}, grads


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_completions_padded_to_a_bucket_leave_the_loss_and_gradients_alone(family):
    knobs = GrpoKnobs(loss_type="grpo", beta=0.1, num_iterations=2, max_completion_length=8)
    batch = batch_of()
    wide = widen(batch, (8, 16, 24), PAD)
    width = batch["prompt_ids"].shape[1] + batch["completion_ids"].shape[1]
    assert width not in (8, 16, 24)
    assert model_inputs(wide, CPU)["input_ids"].shape[1] == next(w for w in (8, 16, 24) if w >= width)
    assert (wide["completion_mask"][:, batch["completion_ids"].shape[1]:] == 0).all()
    assert widen(wide, (8, 16, 24), PAD) is wide  # a row at a bucket's width stays as it is
    model = tiny(family)
    loss, metrics, grads = loss_and_grads(model, batch, knobs)
    loss_w, metrics_w, grads_w = loss_and_grads(model, wide, knobs)
    assert loss_w == pytest.approx(loss, rel=1e-6) and metrics_w == pytest.approx(metrics, rel=1e-6)
    for a, b in zip(grads, grads_w, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def test_the_launch_bound_estimate_counts_num_generations_rows():
    from test_compile_plan import H200, model_of

    model = model_of("gpt2")
    sft = step_math_ms(resolve(None, {"mode": "sft", "batch_size": 4}), model, FAMILIES["gpt2"], 512, H200)
    grpo = step_math_ms(resolve(None, {"mode": "grpo", "batch_size": 4, "num_generations": 8}), model,
                        FAMILIES["gpt2"], 512, H200)  # fmt: skip
    assert grpo == pytest.approx(8 * sft)


def decisions(run) -> dict:
    return {d["setting"]: d for d in json.loads((run / "config.json").read_text())["decisions"]}


def compiled_and_eager(root, monkeypatch, name: str, *more: str, backend: str = "aot_eager",
                       ) -> tuple[dict, list, list, set]:  # fmt: skip
    """(the compiled run's summary, its metrics rows, the eager run's, the widths its compiled forwards
    took), two runs of the same settings; the eager one leaves COMPILE empty (a CPU: off)."""
    assert run_cli(*grpo_argv(root, f"{name}-eager", *more)) == 0
    eager = root / "runs" / f"{name}-eager"
    made = decisions(eager)
    assert made["compile"]["value"] is False and made["compile"]["reason"].startswith("cpu:"), made["compile"]
    assert "length_buckets" not in made
    widths, mark = set(), wrapper.mark_shapes

    def marked(kwargs, bucketed):  # called for the compiled model's calls only
        assert bucketed
        widths.add(kwargs["input_ids"].shape[1])
        return mark(kwargs, bucketed)

    monkeypatch.setattr(wrapper, "mark_shapes", marked)
    monkeypatch.setattr(wrapper, "BACKEND", backend)
    assert run_cli(*grpo_argv(root, f"{name}-compiled", *more, "--compile", "1")) == 0
    run = root / "runs" / f"{name}-compiled"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["compile"]["enabled"] is True, summary["compile_error"]
    buckets = decisions(run)["length_buckets"]["value"]
    assert widths and widths <= {int(w) for w in buckets.split(",")}, (widths, buckets)
    return summary, rows_of(run), rows_of(eager), widths


def same_steps(compiled: list, eager: list, names: tuple[str, ...]) -> None:
    assert len(compiled) == len(eager) > 0
    for a, b in zip(compiled, eager, strict=True):
        for name in names:
            assert a[name] == pytest.approx(b[name], **TOLERANCE), (a["step"], name, a[name], b[name])


@pytest.fixture
def prompts_and_reward(tmp_path) -> tuple[str, ...]:
    """DATA_PATH and REWARD_FUNCS flags: PROMPTS, and a reward that tells completions apart from the first
    step (zero advantages would leave the KL term's rounding noise as the only gradient, which Adam scales
    up to a whole step, and a compiled and an eager forward round apart)."""
    data, rewards = tmp_path / "prompts.jsonl", tmp_path / "my_rewards.py"
    data.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    rewards.write_text("def chars(completions, **kwargs):\n    return [len(c) / 10 for c in completions]\n")
    return "--data_path", str(data), "--reward_funcs", f"{rewards}:chars"


def test_compiled_loss_with_old_logps_and_a_reference_copy_equals_eager_without_recompiles(
    sft_runs, prompts_and_reward, monkeypatch  # noqa: F811
):
    summary, compiled, eager, widths = compiled_and_eager(
        sft_runs, monkeypatch, "full", *prompts_and_reward, "--beta", "0.04", "--num_iterations", "2",
        "--max_steps", "4",
    )  # fmt: skip
    print("compile", summary["compile"], "widths", sorted(widths))
    # two graphs, both made by the trial step: the loss's (with grad) and the old log-probs' (no grad)
    assert summary["compile"] | {"graphs": None} == {**wrapper.not_compiled()["compile"], "enabled": True,
                                                      "mode": "default", "graph_breaks": 0, "recompiles": 0}
    assert summary["compile"]["graphs"] == 2
    assert len(widths) >= 2  # one graph, several widths
    same_steps(compiled, eager, ("loss", "reward", "kl", "entropy", "completions/mean_length"))


def test_lora_with_the_adapters_reference_trains_compiled_as_eager(
    sft_runs, prompts_and_reward, monkeypatch  # noqa: F811
):
    summary, compiled, eager, _ = compiled_and_eager(
        sft_runs, monkeypatch, "lora", *prompts_and_reward, "--lora_r", "4", "--beta", "0.1",
        "--gradient_accumulation_steps", "2", "--max_steps", "2", backend="eager",
    )  # fmt: skip
    print("compile", summary["compile"], [(r["loss"], r["kl"], r["reward"]) for r in compiled])
    c = summary["compile"]
    assert (c["graph_breaks"], c["recompiles"], c["graphs"]) == (0, 0, 1), c
    same_steps(compiled, eager, ("loss", "reward", "kl", "entropy"))


def test_compile_empty_on_a_gpu_stays_on_with_its_buckets(sft_runs, monkeypatch, capsys):  # noqa: F811
    """The plan keeps what COMPILE empty decides on a GPU (it used to turn it off for reward training); a
    dry run, with the device's answer faked (this machine has no GPU: test_compile_plan.py checks it)."""
    from train.run.compile import choose

    assert choose.compile_default(torch.device("cuda"), "none")[0] is True
    monkeypatch.setattr(choose, "compile_default", lambda device, sharding: (True, "a GPU (faked here)"))
    assert run_cli(*grpo_argv(sft_runs, "gpu", "--dry_run", "1", "--max_completion_length", "10")) == 0
    out = capsys.readouterr().out
    assert "compile = True  (a GPU (faked here))" in out, out
    assert "length_buckets = " in out and "the sampling runs eager" in out
