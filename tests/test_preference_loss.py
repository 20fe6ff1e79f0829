"""Preference losses (train/core/preference) against an independent computation (preference_tools):
per-sequence log-prob sums from plain transformers forwards with the full logits (an encoder-decoder's
source run twice, as TRL does), then the DPO / IPO / hinge / SimPO / ORPO formulas written there. Loss,
TRL's reward metrics and the policy's gradients agree to 1e-5 on tiny GPT-2, Llama and T5 models;
accumulation and ranks equal one big batch; the three references agree."""

from __future__ import annotations

import copy
import math
import os
import warnings

import pytest
import torch
from preference_tools import (
    CPU,
    FAMILIES,
    TOL,
    VOCAB,
    build_reference,
    collate,
    gpt2,
    pairs_of,
    plain_loss,
    plain_sums,
    preference_loss,
    reference_over,
    t5,
)  # fmt: skip

from train.core.preference import step_counts
from train.core.preference.logps import Responses, token_logps
from train.core.preference.reference import adapters_off
from train.models.family import CAUSAL_LM, ENCODER_DECODER

CASES = {  # each loss with its knobs: label smoothing and the SFT term where they apply
    "sigmoid": dict(beta=0.5, label_smoothing=0.1, sft_weight=0.3),
    "ipo": dict(beta=0.5),
    "hinge": dict(beta=0.5),
    "simpo": dict(beta=2.0, label_smoothing=0.1, simpo_gamma=0.7),
    "orpo": dict(beta=0.5),
}


def grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(a: dict, b: dict, tol: float = TOL):
    assert a.keys() == b.keys() and a
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=tol, rtol=tol, msg=key)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", CASES)
def test_loss_metrics_and_gradients_equal_the_plain_computation(family, name):
    policy, other = FAMILIES[family](0), FAMILIES[family](1)
    seq2seq = family == "t5"
    batch = collate(pairs_of(3, seed=5), seq2seq)
    knobs = CASES[name]
    reference = build_reference("copy", other) if name in ("sigmoid", "ipo", "hinge") else None
    loss, metrics = preference_loss(
        policy, batch, CPU, "fp32", reference=reference, chunk_tokens=4, loss=name, **knobs
    )
    loss.backward()

    twin = copy.deepcopy(policy)
    twin.zero_grad(set_to_none=True)
    pol, counts = plain_sums(twin, batch)
    with torch.no_grad():
        ref = plain_sums(other, batch)[0] if reference is not None else None
    plain, expected = plain_loss(name, pol, ref, counts, **knobs)
    plain.backward()
    assert loss.item() == pytest.approx(plain.item(), abs=TOL)
    assert_same({k: metrics[k] for k in expected}, {k: v.detach() for k, v in expected.items()})
    if name == "orpo" or knobs.get("sft_weight"):
        assert metrics["nll_loss"].item() == pytest.approx(
            (-pol[:3].sum() / counts[:3].sum()).item(), abs=TOL
        )
    assert_same(grads(policy), grads(twin))


@pytest.mark.parametrize("family", ["gpt2", "t5"])
def test_a_copy_of_the_policy_as_reference_gives_ln2_and_no_reward(family):
    policy = FAMILIES[family](0)
    batch = collate(pairs_of(4, seed=2), family == "t5")
    loss, metrics = preference_loss(policy, batch, CPU, "fp32", reference=build_reference("copy", policy))
    assert loss.item() == pytest.approx(math.log(2), abs=1e-6)
    # (not rewards/accuracies: with rewards of 0 it compares rounding noise, the forward with grad and
    # the reference's without take other kernels, 1e-6 apart on T5)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert metrics[key].item() == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("family", ["gpt2", "t5"])
def test_accumulation_and_ranks_equal_one_big_batch(family):
    """4 micro-batches of 2 pairs (shares of the step's pairs and chosen tokens) = 8 pairs at once;
    and 2 ranks of 4 pairs each, world_size 2, averaged as DDP does = the same."""
    seq2seq = family == "t5"
    policy, other = FAMILIES[family](0), FAMILIES[family](1)
    reference = build_reference("copy", other)
    pairs = pairs_of(8, seed=9)
    kw = dict(reference=reference, loss="sigmoid", beta=0.5, sft_weight=0.4)

    def run(groups, world_size=1):
        policy.zero_grad(set_to_none=True)
        batches = [collate(g, seq2seq) for g in groups]
        n, tokens = step_counts(batches, ENCODER_DECODER if seq2seq else CAUSAL_LM)
        total, sums = 0.0, {}
        for batch in batches:
            loss, metrics = preference_loss(policy, batch, CPU, "fp32", n * world_size, world_size,
                                            chosen_tokens=tokens * world_size, **kw)  # fmt: skip
            loss.backward()
            total += loss.item()
            sums = {k: sums.get(k, 0.0) + v for k, v in metrics.items()}
        return total, sums, grads(policy)

    one, one_metrics, one_grads = run([pairs])
    many, many_metrics, many_grads = run([pairs[i : i + 2] for i in range(0, 8, 2)])
    assert many == pytest.approx(one, abs=TOL)
    assert_same(many_metrics, one_metrics)
    assert_same(many_grads, one_grads)
    halves = [pairs[:4], pairs[4:]]  # two ranks of different token counts, each over the global totals
    counts = [step_counts([collate(h, seq2seq)], ENCODER_DECODER if seq2seq else CAUSAL_LM) for h in halves]
    n, tokens = sum(c[0] for c in counts), sum(c[1] for c in counts)
    rank_losses, rank_grads = [], []
    for half in halves:
        policy.zero_grad(set_to_none=True)
        loss, _ = preference_loss(
            policy, collate(half, seq2seq), CPU, "fp32", n, 2, chosen_tokens=tokens, **kw
        )
        loss.backward()
        rank_losses.append(loss.item())
        rank_grads.append(grads(policy))
    assert sum(rank_losses) / 2 == pytest.approx(one, abs=TOL)
    assert_same({k: (rank_grads[0][k] + rank_grads[1][k]) / 2 for k in one_grads}, one_grads)


def lora_policy(base):
    """The kit's LoRA shape (lora.wrap): the transformers model with peft's layers inside, the
    adapters moved off their zero start so the policy and its base differ."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True
    )
    with warnings.catch_warnings():  # peft asks the deprecated is_gradient_checkpointing (as lora.wrap says)
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        model = get_peft_model(copy.deepcopy(base), config).base_model.model
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2, generator=torch.Generator().manual_seed(len(name)))
    return model


def with_reference(batch: dict, chosen, rejected) -> dict:
    """The batch with the cached reference columns the precomputed reference reads."""
    return {
        **batch,
        "ref_chosen_logps": torch.as_tensor(chosen),
        "ref_rejected_logps": torch.as_tensor(rejected),
    }


def test_precomputed_and_adapters_equal_a_copy():
    base = gpt2(3)
    policy = lora_policy(base)
    batch = collate(pairs_of(3, seed=4), seq2seq=False)
    stored = with_reference(batch, *reference_over(base, [batch], CPU, "fp32"))
    results = {}
    for kind, b in (("copy", batch), ("precomputed", stored), ("adapters", batch)):
        policy.zero_grad(set_to_none=True)
        loss, metrics = preference_loss(
            policy,
            b,
            CPU,
            "fp32",
            reference=build_reference(kind, base if kind == "copy" else policy),
            loss="sigmoid",
            beta=0.5,
        )
        loss.backward()
        results[kind] = (loss.detach(), metrics, grads(policy))
    assert abs(results["copy"][1]["rewards/margins"].item()) > 1e-3  # the adapters do change the policy
    for kind in ("precomputed", "adapters"):
        assert results[kind][0].item() == pytest.approx(results["copy"][0].item(), abs=TOL)
        assert_same(results[kind][1], results["copy"][1])
        assert_same(results[kind][2], results["copy"][2])
    trained = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained) and set(results["adapters"][2]) == trained
    # the frozen head's path (hidden-state gradient made in the forward) against the full logits
    twin = copy.deepcopy(policy)
    twin.zero_grad(set_to_none=True)
    pol, counts = plain_sums(twin, batch)
    with torch.no_grad():
        ref = plain_sums(base, batch)[0]
    plain_loss("sigmoid", pol, ref, counts, beta=0.5)[0].backward()
    assert_same(results["adapters"][2], grads(twin))
    # adapters_off leaves the policy as it found it; a part in eval mode on purpose stays so
    policy.transformer.h[0].eval()
    with adapters_off(policy) as off:
        assert not off.training and all(m.disable_adapters for m in off.modules() if hasattr(m, "lora_A"))
    assert policy.training and not policy.transformer.h[0].training and policy.transformer.h[1].training
    assert all(p.requires_grad for n, p in policy.named_parameters() if "lora_" in n)
    with pytest.raises(ValueError, match="LORA_R"):
        build_reference("adapters", gpt2(0))(gpt2(0), {}, {}, None)


@pytest.mark.parametrize("head_trained", [True, False])
@pytest.mark.parametrize("chunk", [1, 5, 1000])
def test_token_logps_and_gradients_equal_the_full_logits(head_trained, chunk):
    """Per-token weights that differ (a sequence's DPO weight): both backward schemes are exact."""
    g = torch.Generator().manual_seed(chunk)
    hidden = torch.randn(23, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=head_trained)
    targets = torch.randint(0, 50, (23,), generator=g)
    upstream = torch.randn(23, generator=g)
    out = token_logps(hidden, weight, targets, chunk_tokens=chunk)
    plain = (hidden @ weight.T).log_softmax(-1).gather(1, targets[:, None])[:, 0]
    torch.testing.assert_close(out, plain, atol=TOL, rtol=0)
    wanted = (hidden, weight) if head_trained else (hidden,)
    ours, theirs = (torch.autograd.grad((x * upstream).sum(), wanted) for x in (out, plain))
    assert_same(dict(enumerate(ours)), dict(enumerate(theirs)))
    with torch.no_grad():
        assert token_logps(hidden, weight, targets, chunk_tokens=chunk).grad_fn is None


def test_bf16_autocast_runs_and_stays_close():
    policy, other = gpt2(0), gpt2(1)
    batch = collate(pairs_of(3, seed=5), seq2seq=False)
    reference = build_reference("copy", other)
    fp32, _ = preference_loss(policy, batch, CPU, "fp32", reference=reference, beta=0.5)
    bf16, metrics = preference_loss(policy, batch, CPU, "bf16", reference=reference, beta=0.5)
    bf16.backward()
    assert bf16.dtype == torch.float32 and metrics["logps/chosen"].dtype == torch.float32
    assert bf16.item() == pytest.approx(fp32.item(), abs=0.02) and bf16.item() != fp32.item()
    assert all(torch.isfinite(p.grad).all() for p in policy.parameters())


def test_t5_runs_its_encoder_once_per_pair_and_saves_flops():
    from torch.utils.flop_counter import FlopCounterMode

    policy = t5(0)
    batch = collate(pairs_of(4, seed=1), seq2seq=True)
    calls = []
    policy.encoder.register_forward_pre_hook(
        lambda m, a, k: calls.append(k["input_ids"].shape[0]), with_kwargs=True
    )
    with FlopCounterMode(display=False) as ours:
        preference_loss(policy, batch, CPU, "fp32", loss="simpo")[0].backward()
    assert calls == [4]  # the P sources, once
    with FlopCounterMode(display=False) as trl:
        pol, counts = plain_sums(policy, batch)
        plain_loss("simpo", pol, None, counts)[0].backward()
    assert calls == [4, 8] and ours.get_total_flops() < trl.get_total_flops()


def test_bad_input_is_one_clear_error():
    policy = gpt2(0)
    batch = collate(pairs_of(2, seed=0), seq2seq=False)
    with pytest.raises(ValueError, match="DPO_LOSS='kto'"):
        preference_loss(policy, batch, CPU, "fp32", loss="kto")
    with pytest.raises(ValueError, match="reference model"):
        preference_loss(policy, batch, CPU, "fp32", loss="sigmoid")
    with pytest.raises(ValueError, match="ref_chosen_logps"):
        preference_loss(policy, batch, CPU, "fp32", reference=build_reference("precomputed", policy))
    with pytest.raises(ValueError, match="2P rows"):
        Responses.of({k: v[:3] for k, v in batch.items()}, shifted=True)
    with pytest.raises(ValueError, match="expected one of copy, precomputed, adapters"):
        build_reference("frozen", policy)


@pytest.mark.parametrize("family", ["gpt2", "t5"])
def test_no_host_sync_in_a_micro_step(family):
    """Forward and backward of a micro-batch read nothing back from the device (the counter plays
    the GPU on the CPU: the loader's batches are host tensors until they move)."""
    from train.core.measure.syncs import HostSyncs

    policy, other = FAMILIES[family](0), FAMILIES[family](1)
    reference = build_reference("copy", other)
    batches = iter([collate(pairs_of(3, seed=5), family == "t5")])
    with HostSyncs("cpu") as syncs:
        batch = next(syncs.host_batches(batches))
        loss, metrics = preference_loss(policy, batch, CPU, "fp32", reference=reference, sft_weight=0.2)
        loss.backward()
    assert syncs.count == 0, syncs.summary()
    assert all(torch.is_tensor(v) for v in metrics.values())


def _ddp_worker(rank, world_size, port):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        policy, reference = gpt2(0), build_reference("copy", gpt2(1))
        pairs = pairs_of(4, seed=9)
        kw = dict(reference=reference, loss="sigmoid", beta=0.5, sft_weight=0.4)
        alone = copy.deepcopy(policy)
        preference_loss(alone, collate(pairs, False), CPU, "fp32", **kw)[0].backward()
        mine = collate(pairs[2 * rank : 2 * rank + 2], False)  # ranks with different token counts
        totals = torch.tensor(step_counts([mine], CAUSAL_LM))
        dist.all_reduce(totals)
        ddp = DistributedDataParallel(policy)
        loss, _ = preference_loss(
            ddp, mine, CPU, "fp32", int(totals[0]), world_size, chosen_tokens=int(totals[1]), **kw
        )
        loss.backward()
        assert_same(grads(policy), grads(alone))
    finally:
        dist.destroy_process_group()


def test_ddp_two_ranks_equal_one_process():
    """Real DDP (gloo, two processes, the wrapper's own forward and full logits): the ranks' averaged
    gradient of their shares is the gradient of the 4 pairs in one process."""
    from test_distributed import spawn

    spawn(_ddp_worker)


@pytest.mark.parametrize("head_trained", [True, False])
def test_autograd_keeps_nothing_of_the_logits_size(head_trained):
    """What the forward saves for backward (policy and reference): nothing near the (rows x width x
    vocab) logits, which the plain computation keeps."""
    policy = gpt2(0, vocab=2048)
    policy.lm_head.weight.requires_grad_(head_trained)  # tied: the frozen-head path when False
    batch = collate(pairs_of(3, seed=5), seq2seq=False)
    rows, width = batch["input_ids"].shape
    logits_size = rows * (width - 1) * 2048  # the shifted logits
    reference = build_reference("copy", policy)

    params = {p.untyped_storage().data_ptr() for p in policy.parameters()}

    def largest(fn) -> int:  # the largest activation saved (the head's weight is a parameter)
        saved = [0]
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t: saved.append(0 if t.untyped_storage().data_ptr() in params else t.numel()) or t,
            lambda t: t,
        ):
            fn()
        return max(saved)

    ours = largest(lambda: preference_loss(policy, batch, CPU, "fp32", reference=reference, chunk_tokens=8))
    plain = largest(lambda: plain_sums(policy, batch))
    assert plain >= logits_size > 4 * ours


def test_t5_precomputed_equals_a_copy():
    policy, other = t5(0), t5(1)
    batches = [collate(pairs_of(2, seed=s), seq2seq=True) for s in (1, 2)]
    chosen, rejected = reference_over(other, batches, CPU, "fp32")
    assert chosen.shape == rejected.shape == (4,)
    for i, batch in enumerate(batches):
        stored = with_reference(batch, chosen[2 * i : 2 * i + 2], rejected[2 * i : 2 * i + 2])
        a, ma = preference_loss(
            policy, batch, CPU, "fp32", loss="ipo", reference=build_reference("copy", other)
        )
        b, mb = preference_loss(
            policy, stored, CPU, "fp32", loss="ipo", reference=build_reference("precomputed", policy)
        )
        assert a.item() == pytest.approx(b.item(), abs=TOL)
        assert_same(ma, mb)


def test_ipo_logs_dpo_trainers_sums_and_simpo_the_means():
    """TRL 1.16's DPOTrainer normalises IPO's log-ratios by the reply lengths inside the loss only:
    logps/* and rewards/* stay sums over the reply's tokens (CPOTrainer's simpo logs the means). Replies
    of 7 chosen tokens against 1 rejected keep sums and means far apart, so a mix-up cannot pass."""
    g = torch.Generator().manual_seed(3)
    pairs = [(torch.randint(2, VOCAB, (3,), generator=g), torch.randint(2, VOCAB, (7,), generator=g),
              torch.randint(2, VOCAB, (1,), generator=g)) for _ in range(8)]  # fmt: skip
    policy, other = gpt2(0), gpt2(1)
    batch = collate(pairs, False)
    loss, metrics = preference_loss(
        policy, batch, CPU, "fp32", reference=build_reference("copy", other), loss="ipo", beta=0.5
    )
    with torch.no_grad():
        pol, counts = plain_sums(policy, batch)
        ref = plain_sums(other, batch)[0]
    c, r, rc, rr = pol[:8], pol[8:], ref[:8], ref[8:]
    # dpo_trainer.py's ipo branch
    ipo = (((c - rc) / counts[:8] - (r - rr) / counts[8:] - 1 / (2 * 0.5)) ** 2).mean()
    assert loss.item() == pytest.approx(ipo.item(), abs=TOL)
    wc, wr = 0.5 * (c - rc), 0.5 * (r - rr)
    expected = {"logps/chosen": c.mean(), "logps/rejected": r.mean(), "rewards/chosen": wc.mean(),
                "rewards/rejected": wr.mean(), "rewards/margins": (wc - wr).mean(),
                "rewards/accuracies": (wc > wr).float().mean()}  # fmt: skip
    assert_same({k: metrics[k] for k in expected}, expected)
    assert abs(metrics["logps/chosen"].item() - (c / 7).mean().item()) > 1.0  # sums, not the per-token means

    _, simpo = preference_loss(policy, batch, CPU, "fp32", loss="simpo", beta=0.5)
    assert simpo["logps/chosen"].item() == pytest.approx((c / 7).mean().item(), abs=TOL)
    assert simpo["rewards/chosen"].item() == pytest.approx(0.5 * (c / 7).mean().item(), abs=TOL)
