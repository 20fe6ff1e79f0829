"""Reward training's sampling (train/core/reward/sampling.py) on tiny real models of the kit's registry
(GPT-2, Llama, Qwen3, T5: 2 layers, width 32): shapes and groups, greedy against transformers' generate()
and a loop without the cache, seeded sampling against generate() under the same seed, repeatability and
a checkpoint's restore, EOS masks and truncation, TOP_K / TOP_P against transformers' warpers, left
padding, the forward inputs that reproduce the sampling's log-probs, and the KV cache's bytes predicted
(kv_cache.kv_cache_bytes) against the real cache's tensors."""

from __future__ import annotations

import io

import pytest
import torch

from train.core.reward.kv_cache import cache_dtype, kv_cache_bytes
from train.core.reward.logps import Completions, completion_logps, model_inputs
from train.core.reward.sampling import Rollout, Sampler, SamplingSettings, filter_logits, left_pad, pick
from train.models import FAMILIES
from train.models.build import build_model
from train.models.family import set_dropout

VOCAB, EOS, PAD = 96, 1, 0
SHAPES = {
    "gpt2": dict(n_layer=2, n_embd=32, n_head=4, n_positions=64),
    "llama": dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=64, max_position_embeddings=64),
    "qwen3": dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=64, max_position_embeddings=64),
    "t5": dict(num_layers=2, num_decoder_layers=2, d_model=32, d_ff=64, num_heads=4, d_kv=8),
}  # fmt: skip
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]
CAUSAL = ("gpt2", "llama")
ALL = ("gpt2", "llama", "t5")


def tiny(family: str, seed: int = 0):
    """The family's own config at a 2-layer shape, built as the kit builds every new model (T5's
    attention installed); an encoder-decoder's decoder starts from pad, as a tokenizer with pad sets it."""
    cfg = FAMILIES[family].make_config(SHAPES[family], VOCAB, EOS)
    set_dropout(cfg, 0.0)
    if cfg.is_encoder_decoder:
        cfg.pad_token_id = cfg.decoder_start_token_id = PAD
    return build_model(cfg, gradient_checkpointing=False, seed=seed)


def sampler(model, seed: int = 0, eos=(EOS,), **settings) -> Sampler:
    settings = {"num_generations": 2, "max_completion_length": 8, **settings}
    seq2seq = model.config.is_encoder_decoder
    return Sampler(SamplingSettings(**settings), eos_ids=list(eos), pad_id=PAD, device="cpu", seed=seed,
                   decoder_start_id=PAD if seq2seq else None)


def generated(model, prompts, **kw) -> torch.Tensor:
    """transformers' generate() on the same left-padded prompts: the completion part of its output."""
    ids, mask = left_pad(prompts, PAD, "cpu")
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, eos_token_id=EOS, pad_token_id=PAD,
                             use_cache=True, **kw)
    return out[:, 1:] if model.config.is_encoder_decoder else out[:, ids.shape[1]:]


def no_cache_greedy(model, prompts, steps: int) -> torch.Tensor:
    """Greedy by a full forward of everything so far at every step: no cache, nothing carried."""
    ids, mask = left_pad(prompts, PAD, "cpu")
    seq2seq = model.config.is_encoder_decoder
    out = torch.full((len(prompts), 1), PAD) if seq2seq else ids
    with torch.no_grad():
        for _ in range(steps):
            if seq2seq:
                logits = model(input_ids=ids, attention_mask=mask, decoder_input_ids=out).logits
            else:
                written = torch.ones(len(prompts), out.shape[1] - ids.shape[1], dtype=torch.long)
                full = torch.cat([mask, written], 1)
                positions = (full.cumsum(1) - 1).clamp(min=0)
                logits = model(input_ids=out, attention_mask=full, position_ids=positions).logits
            out = torch.cat([out, logits[:, -1].argmax(-1, keepdim=True)], 1)
    return out[:, 1:] if seq2seq else out[:, ids.shape[1]:]


def until_eos(rows: torch.Tensor) -> torch.Tensor:
    """Rows cut after their first EOS, pad after it (what a rollout holds)."""
    is_eos = rows == EOS
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1), rows.shape[1])
    return rows.masked_fill(torch.arange(rows.shape[1])[None] > first[:, None], PAD)


@pytest.mark.parametrize("family", ALL)
def test_each_prompt_has_its_g_completions_in_consecutive_rows(family):
    model = tiny(family)
    r = sampler(model, num_generations=4, max_completion_length=6, temperature=1.0).sample(model, PROMPTS)
    ids, mask = left_pad(PROMPTS, PAD, "cpu")
    assert r.prompt_ids.shape == (12, 7) and r.completion_ids.shape[0] == 12
    assert r.completion_ids.shape[1] <= 6
    assert torch.equal(r.prompt_ids, ids.repeat_interleave(4, 0))
    assert torch.equal(r.prompt_mask, mask.repeat_interleave(4, 0))
    assert r.completion_mask.shape == r.completion_ids.shape == r.sampling_logps.shape
    assert torch.equal(r.lengths, r.completion_mask.sum(1)) and r.lengths.dtype == torch.long
    groups = r.completion_ids.view(3, 4, -1)
    assert any(len({tuple(row.tolist()) for row in g}) > 1 for g in groups)  # draws, not copies
    assert r.seconds > 0 and r.texts is None and r.num_generations == 4 and r.host_syncs >= 1
    # the rows are usable by the loss's backward: plain tensors made under no_grad, not inference tensors
    assert not r.completion_ids.is_inference() and not r.sampling_logps.requires_grad


@pytest.mark.parametrize("family", ALL)
def test_greedy_equals_generate_and_a_loop_without_the_cache(family):
    model = tiny(family).eval()
    r = sampler(model, num_generations=2, max_completion_length=10, temperature=0).sample(model, PROMPTS)
    reference = generated(model, PROMPTS, do_sample=False, max_new_tokens=10)
    plain = no_cache_greedy(model, PROMPTS, 10)
    width = r.completion_ids.shape[1]
    assert torch.equal(r.completion_ids[::2], until_eos(plain)[:, :width])
    assert torch.equal(r.completion_ids[1::2], r.completion_ids[::2])  # greedy: a group's rows agree
    assert torch.equal(r.completion_ids[::2], until_eos(reference)[:, :width])
    top1 = sampler(model, num_generations=2, max_completion_length=10, temperature=1.0, top_k=1)
    assert torch.equal(top1.sample(model, PROMPTS).completion_ids, r.completion_ids)  # TOP_K 1: greedy drawn


@pytest.mark.parametrize("family", ALL)
def test_seeded_sampling_draws_what_generate_draws_from_the_same_seed(family):
    """The same filters in the same order (temperature, top-k, top-p) and one multinomial draw per row per
    step, as generate's: the sampler's generator seeded s draws generate's tokens after manual_seed(s)."""
    model = tiny(family).eval()
    knobs = dict(temperature=0.7, top_k=20, top_p=0.9)
    r = sampler(model, seed=5, num_generations=3, max_completion_length=12, **knobs).sample(model, PROMPTS)
    torch.manual_seed(5)
    theirs = generated(model, PROMPTS, do_sample=True, max_new_tokens=12, num_return_sequences=3, **knobs)
    assert torch.equal(r.completion_ids, until_eos(theirs)[:, : r.completion_ids.shape[1]])


def test_seeded_runs_repeat_without_touching_the_global_generator_and_ranks_differ():
    model = tiny("llama")
    knobs = dict(num_generations=3, max_completion_length=8, temperature=1.0)
    first = sampler(model, seed=3, **knobs).sample(model, PROMPTS).completion_ids
    before = torch.get_rng_state()
    torch.manual_seed(1234)  # the global generator's state has no say in the draws
    state = torch.get_rng_state()
    again = sampler(model, seed=3, **knobs).sample(model, PROMPTS).completion_ids
    assert torch.equal(torch.get_rng_state(), state) and not torch.equal(before, state)
    assert torch.equal(first, again)
    other = sampler(model, seed=4, **knobs).sample(model, PROMPTS).completion_ids
    assert not torch.equal(first, other)
    rank1 = Sampler(SamplingSettings(**knobs), eos_ids=[EOS], pad_id=PAD, device="cpu", seed=3, rank=1)
    assert torch.equal(rank1.sample(model, PROMPTS).completion_ids, other)  # SEED + rank


def test_a_restored_state_repeats_the_uninterrupted_run():
    model = tiny("gpt2")
    knobs = dict(num_generations=2, max_completion_length=6, temperature=1.0, top_p=0.95)
    batches = [PROMPTS, [[20, 21, 22]], [[30], [31, 32, 33, 34]]]
    straight = sampler(model, seed=7, **knobs)
    uninterrupted = [straight.sample(model, b).completion_ids for b in batches]
    first = sampler(model, seed=7, **knobs)
    assert torch.equal(first.sample(model, batches[0]).completion_ids, uninterrupted[0])
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)  # as a checkpoint's state.pt holds it
    buffer.seek(0)
    resumed = sampler(model, seed=99, **knobs)  # another seed: the state decides
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    for batch, expected in zip(batches[1:], uninterrupted[1:], strict=True):
        assert torch.equal(resumed.sample(model, batch).completion_ids, expected)


def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB)} | {"<pad>": PAD, "<eos>": EOS}
    word = Tokenizer(models.WordLevel(vocab, unk_token="w2"))
    word.pre_tokenizer, word.decoder = pre_tokenizers.WhitespaceSplit(), decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=word, eos_token="<eos>", pad_token="<pad>")


def test_eos_masks_what_follows_it_and_a_row_without_one_is_truncated():
    """A crafted case on a real model: greedy, with the EOS set to a token the model writes in some rows."""
    model = tiny("gpt2").eval()
    free = sampler(model, eos=(VOCAB - 1,), temperature=0, max_completion_length=8).sample(model, PROMPTS)
    assert free.completion_ids.shape[1] == 8 and bool(free.is_truncated.all())
    rows = free.completion_ids[::2]
    stop = int(rows[1, 3]) if int(rows[1, 3]) not in rows[1, :3].tolist() else int(rows[1, 0])
    s = sampler(model, eos=(stop,), temperature=0, max_completion_length=8)
    s.tokenizer = tokenizer()
    r = s.sample(model, PROMPTS)
    for row, whole in zip(range(0, 6, 2), rows, strict=True):
        hits = (whole == stop).nonzero()
        end = int(hits[0]) + 1 if len(hits) else 8
        assert int(r.lengths[row]) == end and bool(r.is_truncated[row]) == (not len(hits))
        assert r.completion_mask[row].tolist() == [1] * end + [0] * (r.completion_ids.shape[1] - end)
        assert r.completion_ids[row, :end].tolist() == whole[:end].tolist()
        assert set(r.completion_ids[row, end:].tolist()) <= {PAD}
        assert r.texts[row] == " ".join(f"w{i}" for i in whole[:end].tolist() if i not in (PAD, EOS))
    assert r.completion_ids.shape[1] == int(r.lengths.max())
    assert bool(r.is_truncated[0]) == (stop not in rows[0].tolist()) and not bool(r.is_truncated[2])


def test_sampling_stops_when_every_row_has_ended_or_when_all_ranks_have():
    model = tiny("llama").eval()
    forwards = []
    model.register_forward_hook(lambda *_: forwards.append(1))
    first = sampler(model, temperature=0, max_completion_length=8).sample(model, [[40, 41]]).completion_ids
    stop = int(first[0, 1])  # every row of this one prompt writes it second under greedy
    forwards.clear()
    r = sampler(model, eos=(stop,), temperature=0, max_completion_length=8).sample(model, [[40, 41]])
    assert r.completion_ids.shape[1] == int(r.lengths.max()) <= 2 and not bool(r.is_truncated.any())
    assert r.host_syncs <= 3 and len(forwards) <= 2  # one check per token drawn and the trim; not 8 forwards
    # a rank whose rows have ended keeps stepping while another's run (FSDP2's gathers): pad, trimmed away
    forwards.clear()
    s = sampler(model, eos=(stop,), temperature=0, max_completion_length=8)
    s.all_done = lambda done: False
    synced = s.sample(model, [[40, 41]])
    assert len(forwards) == 8 and torch.equal(synced.completion_ids, r.completion_ids)


def test_top_p_and_top_k_filter_a_crafted_distribution_as_transformers_does():
    from transformers import TopKLogitsWarper, TopPLogitsWarper

    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    scores = probs.log()
    kept = lambda s: (s > float("-inf")).int().tolist()[0]  # noqa: E731
    assert kept(filter_logits(scores, top_p=0.75)) == [0, 1, 0, 1]  # 0.5 + 0.3 reach 0.75
    assert kept(filter_logits(scores, top_p=0.9)) == [0, 1, 1, 1]
    assert kept(filter_logits(scores, top_p=0.4)) == [0, 1, 0, 0]  # at least the likeliest
    assert kept(filter_logits(scores, top_k=2)) == [0, 1, 0, 1]
    assert kept(filter_logits(scores, top_k=3, top_p=0.75)) == [0, 1, 0, 1]
    wide = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(0))
    theirs = TopPLogitsWarper(0.8)(None, TopKLogitsWarper(30)(None, wide.clone()))
    assert torch.equal(filter_logits(wide, top_k=30, top_p=0.8), theirs)
    # draws land on the kept tokens only, in their renormalised shares
    settings = SamplingSettings(temperature=1.0, top_p=0.75)
    tokens, logps = pick(scores.expand(40_000, 4), settings, torch.Generator().manual_seed(0))
    share = torch.bincount(tokens, minlength=4) / 40_000
    assert share[0] == share[2] == 0 and abs(float(share[1]) - 0.5 / 0.8) < 0.01
    assert torch.allclose(logps[tokens == 1], probs[0, 1].log())  # log p before the filter (TRL's loss's)


@pytest.mark.parametrize("family", ALL)
def test_left_padding_leaves_a_prompt_completion_as_it_is_alone(family):
    model = tiny(family).eval()
    short, long = [12, 13], [30, 31, 32, 33, 34, 35, 36, 37, 38]
    s = lambda: sampler(model, temperature=0, max_completion_length=10)  # noqa: E731
    alone = s().sample(model, [short]).completion_ids[0]
    batched = s().sample(model, [long, short]).completion_ids[2]
    assert batched.tolist()[: len(alone)] == alone.tolist() and set(batched.tolist()[len(alone):]) <= {PAD}


def policy_logps(model, r: Rollout, temperature: float, drop=()) -> torch.Tensor:
    """The completion tokens' log-probs from one plain forward over forward_inputs (TRL's way: C + 1 logits
    kept, the last dropped), without the inputs named in drop."""
    inputs = {k: v for k, v in r.forward_inputs().items() if k not in drop}
    if r.decoder_start_id is not None:
        logits = model(**inputs).logits
    else:
        keep = inputs.pop("logits_to_keep")
        logits = model(**inputs, logits_to_keep=keep + 1).logits[:, :-1]
    return (logits / temperature).log_softmax(-1).gather(2, r.completion_ids[..., None]).squeeze(2)


@pytest.mark.parametrize("family", ALL)
def test_forward_inputs_give_back_the_sampling_log_probs(family):
    """The positions, masks and shifts of forward_inputs are the sampling's: a forward over them (the old
    log-probs of NUM_ITERATIONS > 1, and the loss's) finds each drawn token's log-prob again."""
    model = tiny(family)
    model.train()
    r = sampler(model, num_generations=3, max_completion_length=9, temperature=0.8).sample(model, PROMPTS)
    assert model.training  # the mode it was in, back
    model.eval()
    with torch.no_grad():
        again = policy_logps(model, r, 0.8)
    torch.testing.assert_close(again * r.completion_mask, r.sampling_logps, atol=1e-5, rtol=1e-5)
    if family == "gpt2":  # learned positions: TRL's forward (no position_ids) counts the left padding
        with torch.no_grad():
            shifted = policy_logps(model, r, 0.8, drop=("position_ids",))
        assert float(((shifted - again) * r.completion_mask).abs().max()) > 1e-2
    if r.decoder_start_id is None:  # the training path (the loss's, the old log-probs') scores the same
        scored = {"prompt_ids": r.prompt_ids, "prompt_mask": r.prompt_mask,
                  "completion_ids": r.completion_ids, "completion_mask": r.completion_mask}  # fmt: skip
        with torch.no_grad():
            inputs = model_inputs(scored, torch.device("cpu"))
            trained, _ = completion_logps(model, inputs, Completions.of(scored), 0.8)
        torch.testing.assert_close(trained, r.sampling_logps, atol=1e-5, rtol=1e-5)
    model.train()  # and the ids feed a backward
    loss = -(policy_logps(model, r, 0.8) * r.completion_mask).sum()
    loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("family", [*ALL, "qwen3"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_kv_cache_bytes_equal_the_real_cache(family, precision):
    model = tiny(family)
    s = sampler(model, num_generations=3, max_completion_length=7, temperature=1.0, eos=(VOCAB - 1,))
    s.precision = precision
    r = s.sample(model, PROMPTS)
    dtype = cache_dtype(model.config, precision)  # llama's and qwen3's stay float32 under bf16 autocast
    assert (dtype == torch.bfloat16) == (precision == "bf16" and family in ("gpt2", "t5"))
    width, drawn, rows = r.prompt_ids.shape[1], r.completion_ids.shape[1], 9
    assert drawn == 7  # nothing stops early: the cache holds every token fed back (all but the last)
    if model.config.is_encoder_decoder:  # the decoder's start and tokens, and the source's cross keys
        expected = kv_cache_bytes(model.config, rows, drawn, dtype, source_length=width)
    else:
        expected = kv_cache_bytes(model.config, rows, width + drawn - 1, dtype)
    assert r.cache_bytes == expected > 0


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen3", "t5"])
def test_kv_cache_bytes_of_a_model_size_equal_its_real_cache(family):
    """The plan's call: a MODEL_SIZE's config from the registry (nano: 4 layers, width 256)."""
    cfg = FAMILIES[family].config_for("nano", VOCAB, EOS)
    set_dropout(cfg, 0.0)
    if cfg.is_encoder_decoder:
        cfg.pad_token_id = cfg.decoder_start_token_id = PAD
    model = build_model(cfg, gradient_checkpointing=False, seed=0)
    r = sampler(model, num_generations=2, max_completion_length=3, eos=(VOCAB - 1,)).sample(model, PROMPTS)
    width, drawn = r.prompt_ids.shape[1], r.completion_ids.shape[1]
    source = width if cfg.is_encoder_decoder else 0
    length = drawn if cfg.is_encoder_decoder else width + drawn - 1
    assert r.cache_bytes == kv_cache_bytes(cfg, 6, length, cache_dtype(cfg, "fp32"), source_length=source)


def test_settings_and_prompts_out_of_range_are_refused_with_the_knob_named():
    bads = ((dict(num_generations=0), "NUM_GENERATIONS"), (dict(max_completion_length=0), "MAX_COMP"),
            (dict(temperature=-1.0), "TEMPERATURE"), (dict(top_p=0.0), "TOP_P"), (dict(top_k=-1), "TOP_K"),
            (dict(num_generations=True), "NUM_GENERATIONS"),
            (dict(temperature=float("nan")), r">= 0 \(0: greedy"))
    for bad, name in bads:
        with pytest.raises(ValueError, match=name):
            SamplingSettings(**bad)
    model = tiny("gpt2")  # 64 positions
    with pytest.raises(ValueError, match="MAX_COMPLETION_LENGTH: 60 tokens after a prompt of 7"):
        sampler(model, max_completion_length=60).sample(model, PROMPTS)
    with pytest.raises(ValueError, match="at least one token"):
        sampler(model).sample(model, [[3], []])
