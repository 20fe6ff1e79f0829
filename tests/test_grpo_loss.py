"""GRPO's loss core (train/core/reward) against TRL 1.16's formulas transcribed plainly (grpo_tools): the
full logits of a plain forward, then _compute_loss's and _generate_and_score_completions's math. On tiny
GPT-2 and Llama models, loss, every parameter's gradient and every metric agree to 1e-5 for each
LOSS_TYPE (TRL's eight), token and sequence level (vespo: token, sequence refused), BETA 0 and > 0 (a
reference copy), NUM_ITERATIONS 1 and 2 (the second iteration after a real optimizer step, its old
log-probs kept from generation time); the advantages, the reward and completion metrics likewise;
accumulation and ranks give the one big batch's number."""

from __future__ import annotations

import copy

import pytest
import torch
from grpo_tools import (
    CPU,
    EOS,
    EXTRA,
    PAD,
    ROWS,
    G,
    generation_batch,
    generation_logps,
    nanstd,
    plain_advantages,
    plain_logps,
    plain_loss,
    scored_batch,
    take_step,
    tiny,
)  # fmt: skip

from train.core.reward import (
    LOSS_TYPE,
    LOSS_TYPES,
    Completions,
    GrpoKnobs,
    StepCounts,
    completion_logps,
    completion_metrics,
    group_advantages,
    grpo_loss,
    loss_mask,
    model_inputs,
    policy_loss,
    stack_rewards,
    step_counts,
    truncated,
)
from train.core.reward import advantages as adv_module

TOL = 1e-5


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: two threads only spin against each other (measured: 0.06 s of CPU per comparison on
    one thread, 0.9 s on two)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# vespo makes its own sequence ratio, so IMPORTANCE_SAMPLING_LEVEL=sequence is refused for it
LEVELS = [(t, v) for t in LOSS_TYPES for v in ("token", "sequence") if (t, v) != ("vespo", "sequence")]


@pytest.mark.parametrize("mu", [1, 2])
@pytest.mark.parametrize("beta", [0.0, 0.05])
@pytest.mark.parametrize("loss_type, level", LEVELS)
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_loss_gradients_and_metrics_equal_trl(family, loss_type, level, beta, mu):
    knobs = GrpoKnobs(loss_type=loss_type, importance_sampling_level=level, beta=beta, num_iterations=mu,
                      num_generations=G, temperature=0.7, **EXTRA[loss_type])  # fmt: skip
    policy = tiny(family, seed=0)
    reference = copy.deepcopy(policy)
    batch = scored_batch(knobs)
    if beta:
        batch["ref_per_token_logps"] = generation_logps(reference, batch, knobs)
    assert knobs.keeps_old_logps(gradient_accumulation_steps=1) == (mu > 1)
    if mu > 1:
        batch["old_per_token_logps"] = generation_logps(policy, batch, knobs)
        take_step(policy, batch, knobs)
    loss, metrics = grpo_loss(policy, batch, CPU, "fp32", knobs=knobs, chunk_tokens=5)
    loss.backward()

    twin = copy.deepcopy(policy)
    twin.zero_grad(set_to_none=True)
    logps, entropies = plain_logps(twin, batch, knobs.temperature)
    plain, expected = plain_loss(logps, entropies, batch, knobs)
    plain.backward()
    assert loss.item() == pytest.approx(plain.item(), abs=TOL)
    assert metrics.keys() == expected.keys()
    for name, value in expected.items():
        assert metrics[name].item() == pytest.approx(value, abs=TOL, nan_ok=True), name
    got, want = grads(policy), grads(twin)
    assert got.keys() == want.keys() == {n for n, _ in policy.named_parameters()}
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=TOL, rtol=TOL, msg=name)
    if mu > 1:  # the second iteration's policy is not the sampler: ratios move, the clip can bite
        mask = batch["completion_mask"].bool()
        assert (logps.detach() - batch["old_per_token_logps"])[mask].abs().max() > 1e-2
    elif beta:  # the first step's policy is its reference
        assert metrics["kl"].item() == pytest.approx(0.0, abs=1e-7)


@pytest.mark.parametrize("loss_type", ["dapo", "cispo", "vespo"])
def test_the_clip_and_the_kl_are_exercised(loss_type):
    """The comparisons above are not vacuous: after one step the ratios leave [1 - eps, 1 + eps_high]
    on both sides (cispo's cap bites), vespo's weights leave 1 and the KL to the reference is positive."""
    knobs = GrpoKnobs(loss_type=loss_type, beta=0.05, num_iterations=2, num_generations=G,
                      **{**EXTRA[loss_type], "epsilon": 0.05})  # fmt: skip
    policy = tiny("gpt2", seed=0)
    batch = scored_batch(knobs)
    batch["ref_per_token_logps"] = generation_logps(copy.deepcopy(policy), batch, knobs)
    batch["old_per_token_logps"] = generation_logps(policy, batch, knobs)
    take_step(policy, batch, knobs)
    _, metrics = grpo_loss(policy, batch, CPU, "fp32", knobs=knobs)
    assert metrics["kl"] > 1e-4
    if loss_type == "cispo":
        assert metrics["cispo_clip_ratio"] > 0
    elif loss_type == "vespo":
        assert abs(metrics["vespo/phi_seq_mean"] - 1) > 1e-2
    else:
        assert metrics["clip_ratio/low_mean"] > 0 and metrics["clip_ratio/high_mean"] > 0


@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_and_reward_metrics_equal_trl(scale, aggregation):
    nan = float("nan")
    # group 0: mixed; group 1: equal rewards (zero std); group 2: one completion no function scores
    score = [1.0, 0.0, 2.0, 0.5, 1.0, 1.0, 1.0, 1.0, 3.0, None, -1.0, 0.0]
    length = [None, 4.0, 2.0, None, 0.0, 0.0, 0.0, 0.0, 1.0, None, 2.0, 5.0]
    per_func = stack_rewards({"score": score, "length": length})
    assert per_func.shape == (12, 2) and torch.isnan(per_func[9]).all() and per_func[0, 1].isnan()
    knobs = GrpoKnobs(num_generations=G, scale_rewards=scale, reward_weights=(1.0, 0.5),
                      multi_objective_aggregation=aggregation)  # fmt: skip
    got, metrics = group_advantages(per_func, ["score", "length"], knobs)
    names = ["score", "length"]
    want, expected = plain_advantages(per_func, torch.tensor([1.0, 0.5]), G, scale, aggregation, names)
    torch.testing.assert_close(got, want, atol=TOL, rtol=TOL)
    assert got[9] == 0 and not torch.isnan(got).any() and nan != nan
    assert metrics.keys() == expected.keys()
    for name, value in expected.items():
        assert metrics[name] == pytest.approx(value, abs=TOL, nan_ok=True), name


def test_nanstd_is_trls():
    x = torch.tensor([[1.0, float("nan"), 3.0], [float("nan"), float("nan"), 2.0]])
    for dim in (None, 0, 1):
        torch.testing.assert_close(adv_module.nanstd(x, dim), nanstd(x, dim), equal_nan=True)
    assert adv_module.nanstd(torch.tensor([2.0])).isnan()  # one value: no sample std


def test_completion_metrics_truncation_and_mask():
    completions = [[5, 6, EOS], [7, 8, 9, 10], [EOS], [4, PAD]]
    cut = truncated(completions, [EOS, PAD])
    assert cut.tolist() == [False, True, False, False]
    metrics = completion_metrics(torch.tensor([len(c) for c in completions]), cut)
    assert metrics == {
        "completions/mean_length": 2.5, "completions/min_length": 1.0, "completions/max_length": 4.0,
        "completions/clipped_ratio": 0.25, "completions/mean_terminated_length": 2.0,
        "completions/min_terminated_length": 1.0, "completions/max_terminated_length": 3.0,
    }  # fmt: skip
    mask = torch.ones(4, 4, dtype=torch.long)
    assert loss_mask(mask, cut, GrpoKnobs()).equal(mask)
    assert loss_mask(mask, cut, GrpoKnobs(mask_truncated_completions=True))[1].sum() == 0
    none_ended = completion_metrics(torch.tensor([4, 4]), torch.tensor([True, True]))
    assert none_ended["completions/mean_terminated_length"] == 0.0


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_accumulation_is_one_big_batch(loss_type):
    """Two micro-batches of unequal token counts: their shares' gradients add up to one big batch's
    (grpo, dr_grpo, dapo), or to TRL's mean of the micro-batches' token means (bnpo, by definition)."""
    knobs = GrpoKnobs(loss_type=loss_type, num_generations=G, temperature=0.7)
    policy = tiny("gpt2", seed=1)
    whole = scored_batch(knobs, seed=4)
    halves = [{k: v[i * G : (i + 1) * G] for k, v in whole.items()} for i in range(2)]
    assert halves[0]["completion_mask"].sum() != halves[1]["completion_mask"].sum()
    counts = step_counts(halves)
    tokens = int(whole["completion_mask"].sum())
    assert (counts.sequences, counts.tokens, counts.micro_batches) == (ROWS, tokens, 2)
    totals = {}
    for half in halves:
        share, metrics = grpo_loss(policy, half, CPU, "fp32", counts, knobs=knobs, chunk_tokens=3)
        share.backward()
        totals = {k: totals.get(k, 0) + v for k, v in metrics.items()}
    twin = copy.deepcopy(policy)
    twin.zero_grad(set_to_none=True)
    if loss_type == "bnpo":
        plain = sum(plain_loss(*plain_logps(twin, h, 0.7), h, knobs)[0] for h in halves) / 2
    else:
        plain = plain_loss(*plain_logps(twin, whole, 0.7), whole, knobs)[0]
    plain.backward()
    got, want = grads(policy), grads(twin)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=TOL, rtol=TOL, msg=name)
    entropy = [plain_loss(*plain_logps(twin, h, 0.7), h, knobs)[1]["entropy"] for h in halves]
    # a metric: TRL's mean of the micro-steps' values
    assert totals["entropy"].item() == pytest.approx(sum(entropy) / 2, abs=TOL)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_ranks_average_to_the_same_step(loss_type):
    """Two ranks of one micro-batch each, sequences and tokens summed over the ranks, micro-batches
    their own: DDP's average of the two gradients is the accumulation test's step (TRL's, over ranks)."""
    knobs = GrpoKnobs(loss_type=loss_type, num_generations=G, temperature=0.7)
    policy = tiny("gpt2", seed=1)
    whole = scored_batch(knobs, seed=4)
    halves = [{k: v[i * G : (i + 1) * G] for k, v in whole.items()} for i in range(2)]
    both = step_counts(halves)
    counts = StepCounts(both.sequences, both.tokens, micro_batches=1)
    ranks = [copy.deepcopy(policy) for _ in halves]
    for model, half in zip(ranks, halves, strict=True):
        grpo_loss(model, half, CPU, "fp32", counts, world_size=2, knobs=knobs)[0].backward()
    first, second = grads(ranks[0]), grads(ranks[1])
    average = {name: (first[name] + second[name]) / 2 for name in first}
    for half in halves:  # the same step on one process: two micro-batches
        grpo_loss(policy, half, CPU, "fp32", both, knobs=knobs)[0].backward()
    for name, want in grads(policy).items():
        torch.testing.assert_close(average[name], want, atol=TOL, rtol=TOL, msg=name)


def test_one_token_completions_count_only_kept_tokens():
    """Completions one token wide (C = 1) at token level: a masked row is not a clipped token. TRL's
    metrics tell per-sequence values by their width and would count it (its one known edge here)."""
    knobs = GrpoKnobs(loss_type="dapo", num_generations=2, epsilon=0.1)
    logps = torch.tensor([[-1.0], [-1.0], [-1.0]], requires_grad=True)
    old = torch.tensor([[-0.5], [-0.5], [-0.5]])  # ratio exp(-0.5) < 0.9 on every row
    mask = torch.tensor([[1], [1], [0]])
    advantages = torch.tensor([-1.0, 1.0, -1.0])
    _, metrics = policy_loss(logps, advantages, mask, knobs, StepCounts(3, 2, 1), old=old)
    assert metrics["clip_ratio/low_mean"].item() == pytest.approx(0.5)  # 1 of the 2 kept tokens, not 2 of 3
    assert metrics["clip_ratio/low_min"].item() == 0.0  # the masked row's NaN left out


class Wrapped(torch.nn.Module):
    """A model behind a wrapper (as DDP or torch.compile): the kit cannot reach its head."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, **inputs):
        return self.model(**inputs)


@pytest.mark.parametrize("path", ["chunked", "frozen_head", "wrapped", "unpadded"])
def test_logps_and_entropies_equal_the_full_logits(path):
    policy = tiny("llama", seed=2)
    if path == "frozen_head":
        policy.get_output_embeddings().weight.requires_grad_(False)
    batch, _ = generation_batch(ROWS, seed=5)
    if path == "unpadded":  # no zero in the attention mask: sdpa's causal kernel, no mask at all
        for key in ("prompt_mask", "completion_mask"):
            batch[key] = torch.ones_like(batch[key])
        assert not Completions.of(batch).padded
    weights = torch.randn(batch["completion_mask"].shape, generator=torch.Generator().manual_seed(0))
    model = Wrapped(policy) if path == "wrapped" else policy
    where = Completions.of(batch)
    logps, entropy = completion_logps(model, model_inputs(batch, CPU), where, 1.3, chunk_tokens=2)
    (logps * weights).sum().backward()
    twin = copy.deepcopy(policy)
    twin.zero_grad(set_to_none=True)
    want, want_entropy = plain_logps(twin, batch, 1.3)
    (want * weights).sum().backward()
    torch.testing.assert_close(logps, want, atol=TOL, rtol=TOL)
    torch.testing.assert_close(entropy, want_entropy, atol=TOL, rtol=TOL)
    assert not entropy.requires_grad and (logps[batch["completion_mask"] == 0] == 0).all()
    got, expected = grads(policy), grads(twin)
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=TOL, rtol=TOL, msg=name)


def test_bf16_autocast_matches_the_full_logits_under_it():
    """Under bf16 autocast the chunks' logits are the model head's own bf16 logits (equal log-probs);
    the gradient differs only by where bf16 rounds it (measured: 0.3 % of the largest)."""
    policy = tiny("gpt2", seed=0)
    batch, _ = generation_batch(ROWS, seed=5)
    weights = torch.randn(batch["completion_mask"].shape, generator=torch.Generator().manual_seed(0))
    twin = copy.deepcopy(policy)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        where = Completions.of(batch)
        logps, _ = completion_logps(policy, model_inputs(batch, CPU), where, 0.7, chunk_tokens=3)
        want, _ = plain_logps(twin, batch, 0.7)
    (logps * weights).sum().backward()
    (want * weights).sum().backward()
    assert logps.dtype == torch.float32
    torch.testing.assert_close(logps, want, atol=TOL, rtol=TOL)
    for (name, p), q in zip(policy.named_parameters(), twin.parameters(), strict=True):
        assert (p.grad - q.grad).abs().max() <= 0.02 * q.grad.abs().max(), name


@pytest.mark.parametrize("bad, variable", [
    (dict(loss_type="ppo"), "LOSS_TYPE"), (dict(scale_rewards="std"), "SCALE_REWARDS"),
    (dict(importance_sampling_level="batch"), "IMPORTANCE_SAMPLING_LEVEL"),
    (dict(num_generations=1), "NUM_GENERATIONS"),
    (dict(temperature=0.0), "TEMPERATURE"), (dict(beta=-1.0), "BETA"), (dict(epsilon=1.5), "EPSILON"),
    (dict(delta=0.9), "DELTA"), (dict(num_iterations=0), "NUM_ITERATIONS"),
    (dict(multi_objective_aggregation="mean"), "MULTI_OBJECTIVE_AGGREGATION"),
    (dict(loss_type="vespo", importance_sampling_level="sequence"), "IMPORTANCE_SAMPLING_LEVEL=sequence"),
    (dict(vespo_k_pos=-1.0), "VESPO_K_POS=-1.0"), (dict(vespo_lambda_neg=0.0), "VESPO_LAMBDA_NEG=0.0"),
])  # fmt: skip
def test_bad_knobs_name_their_variable(bad, variable):
    with pytest.raises(ValueError, match=variable):
        GrpoKnobs(**bad)
    assert tuple(LOSS_TYPE) == LOSS_TYPES  # the knob's choices are the table's rows


def test_bad_rewards_name_their_variable():
    with pytest.raises(ValueError, match="REWARD_WEIGHTS"):
        group_advantages(torch.zeros(4, 2), ["a", "b"], GrpoKnobs(num_generations=2, reward_weights=(1.0,)))
    with pytest.raises(ValueError, match="NUM_GENERATIONS"):
        group_advantages(torch.zeros(6, 1), ["a"], GrpoKnobs(num_generations=4))
    with pytest.raises(ValueError, match="REWARD_FUNCS"):
        stack_rewards({"a": [1.0, 2.0], "b": [1.0]})
    with pytest.raises(ValueError, match="BETA"):  # a KL term without the reference's log-probs
        knobs = GrpoKnobs(beta=0.1, num_generations=G)
        grpo_loss(tiny("gpt2"), scored_batch(knobs), CPU, "fp32", knobs=knobs)
    with pytest.raises(ValueError, match="NUM_ITERATIONS=2"):  # no log-probs of the sampler
        knobs = GrpoKnobs(num_iterations=2, num_generations=G)
        grpo_loss(tiny("gpt2"), scored_batch(knobs), CPU, "fp32", knobs=knobs)


@pytest.mark.parametrize("loss_type, level", [("dapo", "token"), ("dapo", "sequence"), ("vespo", "token")])
def test_no_host_sync_in_a_micro_step(loss_type, level):
    """Counting the step, forward and backward of a micro-batch read nothing back from the device (the
    counter plays the GPU on the CPU: the loader's batches are host tensors until they move)."""
    from train.core.measure.syncs import HostSyncs

    knobs = GrpoKnobs(loss_type=loss_type, beta=0.05, num_iterations=2, num_generations=G,
                      importance_sampling_level=level)  # fmt: skip
    policy = tiny("llama", seed=0)
    batch = scored_batch(knobs)
    batch["ref_per_token_logps"] = generation_logps(copy.deepcopy(policy), batch, knobs)
    batch["old_per_token_logps"] = generation_logps(policy, batch, knobs) + 0.01
    with HostSyncs("cpu") as syncs:
        batch = next(syncs.host_batches(iter([batch])))
        loss, metrics = grpo_loss(policy, batch, CPU, "fp32", step_counts([batch]), knobs=knobs)
        loss.backward()
    assert syncs.count == 0, syncs.summary()
    assert all(torch.is_tensor(v) for v in metrics.values())
