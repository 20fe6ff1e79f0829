"""GRPO's loss against TRL 1.16's own GRPOTrainer._compute_loss, once, outside the tests (which never
import TRL): the same tiny models, batches, advantages, old and reference log-probs and knobs as
tests/test_grpo_loss.py's matrix (GPT-2 and Llama x the 8 LOSS_TYPEs x token/sequence, vespo token only,
x BETA 0/0.05 x NUM_ITERATIONS 1/2), each case computed three ways: TRL's _compute_loss (its fused LM
head at the temperature, add_fused_lm_head, as GRPOTrainer installs it), the tests' plain transcription of it
(tests/grpo_tools.py) and the kit's grpo_loss. Printed: the largest difference of the loss, of any
parameter's gradient and of any metric, plain vs TRL and kit vs TRL; then, per LOSS_TYPE, the
gradient of an optimizer step of two micro-batches (TRL with gradient_accumulation_steps 2, the kit
with its step_counts) kit vs TRL. Runs in a scratch venv that has TRL (never the kit's):

    python3 -m venv /tmp/venv-trl && /tmp/venv-trl/bin/pip install torch==2.13.0 transformers==5.23.0 \\
        accelerate trl==1.16.0
    /tmp/venv-trl/bin/python bench/grpo_vs_trl_loss.py

TRL's method is called on a stand-in for the trainer that holds what _compute_loss reads (one
process, accumulation 1, steps_per_generation 1, no vLLM, no entropy bonus, no MoE): the method's
own code, not a copy of it. Results: bench/RESULTS.md, "GRPO's loss against TRL".
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import sys
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import torch

KIT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(KIT), str(KIT / "tests")]

from grpo_tools import (  # noqa: E402
    CPU,
    EXTRA,
    G,
    generation_logps,
    plain_logps,
    plain_loss,
    scored_batch,
    take_step,
    tiny,
)

from train.core.reward import LOSS_TYPES, GrpoKnobs, grpo_loss, step_counts  # noqa: E402

try:
    from trl.trainer.grpo_trainer import GRPOTrainer
    from trl.trainer.utils import add_fused_lm_head
except ImportError:
    sys.exit("TRL is not importable here: run this with a scratch venv's python (the module doc says how)")


class _Accelerator:
    num_processes, is_main_process = 1, True

    def autocast(self):
        return contextlib.nullcontext()

    def reduce(self, tensor, reduction="sum"):
        return tensor

    def gather(self, tensor):
        return tensor


class TrlSide:
    """What GRPOTrainer._compute_loss reads of its trainer, and the trainer's own two methods."""

    _compute_loss = GRPOTrainer._compute_loss
    _get_per_token_logps_and_entropies = GRPOTrainer._get_per_token_logps_and_entropies
    get_gamma_weights = GRPOTrainer.__dict__["get_gamma_weights"]  # vespo's: a staticmethod, kept one

    def __init__(self, model, k: GrpoKnobs, accumulation: int = 1):
        self.model, self.accelerator, self.state = model, _Accelerator(), SimpleNamespace(global_step=0)
        # TRL's default steps_per_generation: the accumulation (one generation per optimizer step)
        self.args = SimpleNamespace(report_to=[], use_bias_correction_kl=k.use_bias_correction_kl,
                                    delta=k.delta, steps_per_generation=accumulation,
                                    sapo_temperature_pos=k.sapo_temperature_pos,
                                    sapo_temperature_neg=k.sapo_temperature_neg,
                                    vespo_k_pos=k.vespo_k_pos, vespo_k_neg=k.vespo_k_neg,
                                    vespo_lambda_pos=k.vespo_lambda_pos,
                                    vespo_lambda_neg=k.vespo_lambda_neg)  # fmt: skip
        self.beta, self.loss_type = k.beta, k.loss_type
        self.importance_sampling_level = k.importance_sampling_level
        self.epsilon_low, self.epsilon_high = k.epsilon, k.upper_epsilon
        self.max_completion_length = k.max_completion_length
        self.current_gradient_accumulation_steps = accumulation
        self.top_entropy_quantile, self.off_policy_mask_threshold = 1.0, None
        self.use_vllm = self.vllm_importance_sampling_correction = False
        self.aux_loss_enabled = self._entropy_bonus_enabled = False
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}


def drawn_positions(model) -> None:
    """TRL's forward passes no position_ids; the kit scores at the sampler's (counted from each prompt's
    first token: its one deliberate difference, for GPT-2's learned positions). TRL's side is given them
    too, from its attention mask (the same on every kept token), so the two compute one thing."""

    def hook(module, args, kwargs):
        mask = kwargs.get("attention_mask")
        if mask is not None and kwargs.get("position_ids") is None:
            kwargs["position_ids"] = (mask.cumsum(1) - 1).clamp(min=0)
        return args, kwargs

    model.register_forward_pre_hook(hook, with_kwargs=True)


def grads(model) -> dict:
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def biggest(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((torch.as_tensor(a[k]) - torch.as_tensor(b[k])).abs().max()) for k in a)


def one_case(family, loss_type, level, beta, mu) -> dict:
    knobs = GrpoKnobs(loss_type=loss_type, importance_sampling_level=level, beta=beta, num_iterations=mu,
                      num_generations=G, temperature=0.7, **EXTRA[loss_type])  # fmt: skip
    policy = tiny(family, seed=0)
    batch = scored_batch(knobs)
    if beta:
        batch["ref_per_token_logps"] = generation_logps(copy.deepcopy(policy), batch, knobs)
    if mu > 1:
        batch["old_per_token_logps"] = generation_logps(policy, batch, knobs)
        take_step(policy, batch, knobs)
    models = {side: copy.deepcopy(policy) for side in ("trl", "plain", "kit")}
    add_fused_lm_head(models["trl"], temperature=knobs.temperature, outputs=("log_probs", "entropy"))
    drawn_positions(models["trl"])
    trl = TrlSide(models["trl"], knobs)
    inputs = {**batch, "num_items_in_batch": batch["completion_mask"].sum()}
    trl_loss = trl._compute_loss(models["trl"], inputs)
    trl_loss.backward()
    trl_metrics = {name: values[-1] for name, values in trl._metrics["train"].items()}
    plain, plain_metrics = plain_loss(*plain_logps(models["plain"], batch, knobs.temperature), batch, knobs)
    plain.backward()
    kit, kit_metrics = grpo_loss(models["kit"], batch, CPU, "fp32", knobs=knobs, chunk_tokens=5)
    kit.backward()
    kit_metrics = {name: value.item() for name, value in kit_metrics.items()}
    theirs = grads(trl.model)
    return {
        "plain loss": abs(plain.item() - trl_loss.item()),
        "plain grad": biggest(grads(models["plain"]), theirs),
        "plain metric": biggest(plain_metrics, trl_metrics),
        "kit loss": abs(kit.item() - trl_loss.item()),
        "kit grad": biggest(grads(models["kit"]), theirs), "kit metric": biggest(kit_metrics, trl_metrics),
    }  # fmt: skip


def accumulation_case(loss_type: str) -> float:
    """Two micro-batches of unequal token counts, TRL with gradient_accumulation_steps 2 (its
    num_items_in_batch the generation batch's kept tokens) against the kit's shares of step_counts:
    the largest difference of the summed gradients (module doc of train/core/reward/loss.py)."""
    knobs = GrpoKnobs(loss_type=loss_type, num_generations=G, temperature=0.7)
    policy = tiny("gpt2", seed=1)
    whole = scored_batch(knobs, seed=4)
    halves = [{k: v[i * G : (i + 1) * G] for k, v in whole.items()} for i in range(2)]
    theirs, ours = copy.deepcopy(policy), copy.deepcopy(policy)
    add_fused_lm_head(theirs, temperature=knobs.temperature, outputs=("log_probs", "entropy"))
    drawn_positions(theirs)
    trl = TrlSide(theirs, knobs, accumulation=2)
    counts = step_counts(halves)
    for half in halves:
        trl._compute_loss(theirs, {**half, "num_items_in_batch": whole["completion_mask"].sum()}).backward()
        grpo_loss(ours, half, CPU, "fp32", counts, knobs=knobs)[0].backward()
    return biggest(grads(ours), grads(theirs))


def main() -> None:
    torch.set_num_threads(1)
    worst: dict[str, tuple[float, tuple]] = {}
    losses = LOSS_TYPES
    cases = list(itertools.product(("gpt2", "llama"), losses, ("token", "sequence"), (0.0, 0.05), (1, 2)))
    cases = [c for c in cases if c[1:3] != ("vespo", "sequence")]  # refused: vespo makes its own
    for case in cases:
        for name, diff in one_case(*case).items():
            if name not in worst or diff > worst[name][0]:
                worst[name] = (diff, case)
    import transformers
    import trl

    versions = f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}"
    print(f"{len(cases)} cases; {versions}")
    print("largest |difference| from TRL's _compute_loss (family, LOSS_TYPE, level, BETA, NUM_ITERATIONS):")
    for name, (diff, case) in worst.items():
        print(f"  {name:<13} {diff:.3e}   {case}")
    print("accumulation 2, micro-batches of unequal token counts: largest gradient difference, kit vs TRL")
    for loss_type in losses:
        print(f"  {loss_type:<13} {accumulation_case(loss_type):.3e}")


if __name__ == "__main__":
    main()
