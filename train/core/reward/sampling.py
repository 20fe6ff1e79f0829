"""Sampling for reward training: NUM_GENERATIONS completions of each prompt under the policy's current
weights, as TRL's GRPOTrainer samples them with transformers' generate (_generate_single_turn), in one
loop of the model's own forward with its KV cache.

A batch of P prompts becomes P*G rows, prompt i's G completions in rows i*G .. i*G+G-1 (TRL's
RepeatSampler order, so a group's rewards are one row of a (P, G) view). Prompts are left-padded, their
positions counted from each prompt's first token (generate's cumsum of the mask), so padding changes
nothing. Each prompt runs through the model once and its cache is copied G times (a causal LM's past
keys and values, an encoder-decoder's encoder output): the prompt's forward is paid once per prompt, not
G times as generate() pays it for a causal LM (it repeats input_ids before the first forward: 2.8x the
completion tokens per CPU-second at G=8 and 128-192-token prompts, bench/grpo_sampling.py). T5 and the
other encoder-decoders sample this way too: the encoder runs once per prompt (generate()'s way for them).

Tokens are drawn from softmax(logits / TEMPERATURE) after TOP_K then TOP_P filtering (transformers'
order and its filters); TEMPERATURE 0 is greedy. After a row's first EOS its tokens are pad and its mask
0; a row with no EOS within MAX_COMPLETION_LENGTH is truncated (TRL's is_truncated, clipped_ratio).
Sampling stops when every row has ended, asked every `check_every` tokens: a host read-back each time,
so on an accelerator it is asked less often (the extra tokens are pad, dropped from the output). Under
FSDP2 every rank must run as many forwards as the others (each gathers the weights with them): `all_done`
is then a function that asks every rank (an all-reduce of the flag, as transformers' synced_gpus does).

The draws come from a torch.Generator the Sampler owns, seeded SEED + rank (each DDP rank samples its
own prompts differently, as accelerate's device-specific seeds do): the global RNG is never touched, and
state_dict / load_state_dict carry the generator, so a resumed run draws what the uninterrupted one did.
The model is put in eval mode (dropout off) under no_grad (not inference_mode: the ids are inputs of
the loss's backward, and inference tensors cannot be saved for it) and autocast as the run's precision,
then back in the mode it was in. Imports torch and train/core only."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from train.core.device import autocast
from train.core.generation import value_problem
from train.core.model import unwrapped
from train.core.reward.kv_cache import cache_bytes

# A read-back every token stalls an accelerator's queue once per token (transformers' StopCheck does);
# every 8 tokens it costs at most 7 forwards of pad at the end (not measured on a GPU yet).
CHECK_EVERY_ACCELERATOR = 8


@dataclass(frozen=True)
class SamplingSettings:
    """How completions are drawn: the knobs NUM_GENERATIONS, MAX_COMPLETION_LENGTH, TEMPERATURE,
    TOP_P, TOP_K (TRL's GRPOConfig names them the same)."""

    num_generations: int = 8
    max_completion_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        """Each knob against the range generate()'s own setting has (train/core/generation.py's, so
        a GENERATION_CONFIG and these agree); TEMPERATURE 0 is greedy here, as TRL reads it."""
        ranges = (("NUM_GENERATIONS", "num_return_sequences", self.num_generations),
                  ("MAX_COMPLETION_LENGTH", "max_new_tokens", self.max_completion_length),
                  ("TEMPERATURE", "temperature", self.temperature), ("TOP_P", "top_p", self.top_p),
                  ("TOP_K", "top_k", self.top_k))  # fmt: skip
        for name, setting, value in ranges:
            problem = value_problem(setting, value)
            if setting == "temperature" and problem:
                problem = None if value == 0 and not isinstance(value, bool) else problem.replace(
                    "a number > 0", "a number >= 0 (0: greedy)")  # fmt: skip
            if problem:
                raise ValueError(f"{name}: {problem}")


@dataclass
class Rollout:
    """One batch's completions, R = P*G rows, on the sampler's device."""

    prompt_ids: torch.Tensor  # (R, Lp) left-padded with pad, prompt i in rows i*G .. i*G+G-1
    prompt_mask: torch.Tensor  # (R, Lp) 1 on prompt tokens
    completion_ids: torch.Tensor  # (R, C) pad after the first EOS; C: the longest completion
    completion_mask: torch.Tensor  # (R, C) 1 up to and including the first EOS
    is_truncated: torch.Tensor  # (R,) bool: no EOS within MAX_COMPLETION_LENGTH
    lengths: torch.Tensor  # (R,) completion tokens counted by the mask (EOS included)
    sampling_logps: torch.Tensor  # (R, C) float32 log p of each drawn token (logits / TEMPERATURE), 0 off
    texts: list[str] | None  # the completions decoded, special tokens skipped (None without a tokenizer)
    seconds: float  # wall time of the sampling (on CUDA: to the device's end)
    host_syncs: int  # read-backs the sampling made (stop checks and the final trim)
    cache_bytes: int  # the KV cache's bytes at the end, its largest
    num_generations: int
    decoder_start_id: int | None = None  # an encoder-decoder's decoder start token; None: a causal LM

    def forward_inputs(self) -> dict:
        """What a forward of the policy over these completions takes (the old log-probs when
        NUM_ITERATIONS > 1, and the loss's own forward). Causal: prompt and completion side by side,
        the mask of both (nothing after EOS is attended), the positions the sampling used (GPT-2's
        learned positions need them with left padding: without, its positions count the pad, and a
        tiny GPT-2's log-probs of the drawn tokens came out up to 0.31 off the sampling's; rotary
        models are indifferent to the offset) and
        logits_to_keep = C as TRL's _get_per_token_logps takes it (the forward keeps C + 1 logits and
        drops the last; logits t predict completion token t). Encoder-decoder: the prompt is the
        source, the decoder reads the start token and the completion shifted by one."""
        if self.decoder_start_id is not None:
            start = torch.full_like(self.completion_ids[:, :1], self.decoder_start_id)
            ones = torch.ones_like(self.completion_mask[:, :1])
            return {"input_ids": self.prompt_ids, "attention_mask": self.prompt_mask,
                    "decoder_input_ids": torch.cat([start, self.completion_ids[:, :-1]], 1),
                    "decoder_attention_mask": torch.cat([ones, self.completion_mask[:, :-1]], 1)}  # fmt: skip
        mask = torch.cat([self.prompt_mask, self.completion_mask], 1)
        positions = torch.cat([self.prompt_mask, torch.ones_like(self.completion_mask)], 1).cumsum(1) - 1
        return {"input_ids": torch.cat([self.prompt_ids, self.completion_ids], 1), "attention_mask": mask,
                "position_ids": positions.clamp(min=0),
                "logits_to_keep": self.completion_ids.shape[1]}  # fmt: skip


def left_pad(prompts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(P, Lp) ids and mask, each prompt at the right end of its row."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.as_tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    return ids.to(device), mask.to(device)


def filter_logits(scores: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """TOP_K then TOP_P on (rows, vocab) scores, as transformers' TopKLogitsWarper and TopPLogitsWarper:
    the k likeliest kept (ties with the k-th too); then the smallest set of likeliest tokens whose
    probability reaches top_p (at least one). Filtered tokens are -inf."""
    if top_k and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = torch.sort(scores, descending=False)
        cumulative = ordered.softmax(-1).cumsum(-1)
        drop = cumulative <= 1 - top_p
        drop[..., -1:] = False
        scores = scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return scores


def pick(logits: torch.Tensor, settings: SamplingSettings, generator: torch.Generator | None):
    """(tokens, their log-probs under logits / TEMPERATURE) for float32 (rows, vocab) logits: greedy at
    TEMPERATURE 0, else one multinomial draw per row from the filtered distribution."""
    if settings.temperature == 0:
        tokens = logits.argmax(-1)
        scaled = logits
    else:
        scaled = logits / settings.temperature
        probs = filter_logits(scaled, settings.top_k, settings.top_p).softmax(-1)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    logps = scaled.log_softmax(-1).gather(1, tokens[:, None]).squeeze(1)
    return tokens, logps


class _Causal:
    """A decoder-only model: the prompts' forward once, its cache copied G times, then a token a step."""

    def __init__(self, model, ids, mask, groups: int, steps: int):
        self.model, width = model, ids.shape[1]
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                    logits_to_keep=1)
        self.cache = out.past_key_values
        if groups > 1:
            self.cache.batch_repeat_interleave(groups)
        self.logits = out.logits[:, -1].float().repeat_interleave(groups, 0)
        rows = ids.shape[0] * groups
        # the mask for every step at once: the prompt's, then ones (a finished row's pad is never read)
        self.mask = torch.ones((rows, width + steps), dtype=mask.dtype, device=mask.device)
        self.mask[:, :width] = mask.repeat_interleave(groups, 0)
        self.width, self.next_position = width, positions[:, -1:].repeat_interleave(groups, 0) + 1

    def step(self, tokens: torch.Tensor, t: int) -> torch.Tensor:
        out = self.model(input_ids=tokens[:, None], attention_mask=self.mask[:, : self.width + t + 1],
                         position_ids=self.next_position + t, past_key_values=self.cache,
                         use_cache=True)  # fmt: skip
        self.cache = out.past_key_values
        return out.logits[:, -1].float()


class _SourceTarget:
    """An encoder-decoder: the encoder once per prompt, its output copied G times and read by every
    decoder step through the cross-attention cache."""

    def __init__(self, model, ids, mask, groups: int, start_id: int):
        from transformers import DynamicCache, EncoderDecoderCache
        from transformers.modeling_outputs import BaseModelOutput

        hidden = model.get_encoder()(input_ids=ids, attention_mask=mask).last_hidden_state
        self.model, self.mask = model, mask.repeat_interleave(groups, 0)
        self.encoded = BaseModelOutput(last_hidden_state=hidden.repeat_interleave(groups, 0))
        self.cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        start = torch.full((self.mask.shape[0],), start_id, dtype=torch.long, device=ids.device)
        self.logits = self.step(start, -1)

    def step(self, tokens: torch.Tensor, t: int) -> torch.Tensor:
        out = self.model(encoder_outputs=self.encoded, attention_mask=self.mask,
                         decoder_input_ids=tokens[:, None], past_key_values=self.cache, use_cache=True)
        self.cache = out.past_key_values
        return out.logits[:, -1].float()


def context_of(config) -> int | None:
    """The model's position table (GPT-2's n_positions, Llama's max_position_embeddings), or None."""
    for name in ("n_positions", "max_position_embeddings"):
        if isinstance(getattr(config, name, None), int):
            return getattr(config, name)
    return None


class Sampler:
    """Draws a batch's completions; owns the generator the draws come from (its state is a checkpoint's)."""

    def __init__(self, settings: SamplingSettings, *, eos_ids, pad_id: int, device, precision: str = "fp32",
                 seed: int = 0, rank: int = 0,
                 decoder_start_id: int | None = None, tokenizer=None, check_every: int | None = None,
                 all_done=None):
        self.settings, self.precision, self.tokenizer = settings, precision, tokenizer
        self.eos_ids = sorted({int(e) for e in ([eos_ids] if isinstance(eos_ids, int) else eos_ids)})
        if not self.eos_ids:
            raise ValueError("sampling needs at least one EOS id to stop at")
        self.pad_id, self.device = int(pad_id), torch.device(device)
        self.decoder_start_id = decoder_start_id
        self.check_every = check_every or (1 if self.device.type == "cpu" else CHECK_EVERY_ACCELERATOR)
        self.all_done = all_done or (lambda done: bool(done.all()))  # (rows,) bool -> stop now
        self.seed, self.rank = seed, rank
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed + rank)
        self._eos = torch.tensor(self.eos_ids, device=self.device)

    def state_dict(self) -> dict:
        """This rank's generator state (a CPU byte tensor: torch.load(weights_only=True) reads it)."""
        return {"generator": self.generator.get_state(), "seed": self.seed, "rank": self.rank}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])

    def sample(self, model, prompts: list[list[int]]) -> Rollout:
        """G completions of each prompt (token-id lists), under the model's current weights."""
        model = unwrapped(model)
        steps = self.settings.max_completion_length
        context = context_of(model.config)
        if self.decoder_start_id is None and context and max(map(len, prompts), default=0) + steps > context:
            longest = max(map(len, prompts))
            raise ValueError(f"MAX_COMPLETION_LENGTH: {steps} tokens after a prompt of {longest} pass the "
                             f"model's {context} positions")
        was_training = model.training
        model.eval()
        start = time.perf_counter()
        try:
            with torch.no_grad(), autocast(self.device, self.precision):
                rollout = self._sample(model, prompts)
        finally:
            model.train(was_training)
        if self.device.type == "cuda":  # the clock stops when the device is done, not when it was asked
            torch.cuda.synchronize(self.device)
        rollout.seconds = time.perf_counter() - start
        return rollout

    def _sample(self, model, prompts: list[list[int]]) -> Rollout:
        groups, steps = self.settings.num_generations, self.settings.max_completion_length
        ids, mask = left_pad(prompts, self.pad_id, self.device)
        if self.decoder_start_id is not None:
            decoder = _SourceTarget(model, ids, mask, groups, self.decoder_start_id)
        else:
            decoder = _Causal(model, ids, mask, groups, steps)
        logits, rows = decoder.logits, ids.shape[0] * groups
        tokens = torch.full((rows, steps), self.pad_id, dtype=torch.long, device=self.device)
        logps = torch.zeros((rows, steps), dtype=torch.float32, device=self.device)
        done = torch.zeros(rows, dtype=torch.bool, device=self.device)
        syncs = 0
        for t in range(steps):
            drawn, drawn_logps = pick(logits, self.settings, self.generator)
            tokens[:, t] = torch.where(done, self.pad_id, drawn)
            logps[:, t] = drawn_logps.masked_fill(done, 0.0)
            done |= torch.isin(drawn, self._eos)
            if t + 1 == steps:
                break
            if (t + 1) % self.check_every == 0:
                syncs += 1
                if self.all_done(done):
                    break
            logits = decoder.step(tokens[:, t], t)
        return self._rollout(ids, mask, tokens, logps, decoder.cache, syncs)

    def _rollout(self, ids, mask, tokens, logps, cache, syncs: int) -> Rollout:
        groups = self.settings.num_generations
        is_eos = torch.isin(tokens, self._eos)
        has_eos = is_eos.any(1)
        # the first EOS's index (TRL's completion_mask); a row without one keeps every token
        first = torch.where(has_eos, is_eos.int().argmax(1), tokens.shape[1])
        completion_mask = (torch.arange(tokens.shape[1], device=self.device)[None] <= first[:, None]).long()
        lengths = completion_mask.sum(1)
        host_lengths = lengths.tolist()  # the one read-back at the end: the width and the texts need it
        width = max(host_lengths)
        tokens = tokens[:, :width].masked_fill(completion_mask[:, :width] == 0, self.pad_id)
        texts = None
        if self.tokenizer is not None:
            rows = [r[:n] for r, n in zip(tokens.tolist(), host_lengths, strict=True)]
            texts = self.tokenizer.batch_decode(rows, skip_special_tokens=True)
        return Rollout(
            prompt_ids=ids.repeat_interleave(groups, 0), prompt_mask=mask.repeat_interleave(groups, 0),
            completion_ids=tokens, completion_mask=completion_mask[:, :width], is_truncated=~has_eos,
            lengths=lengths, sampling_logps=logps[:, :width] * completion_mask[:, :width], texts=texts,
            seconds=0.0, host_syncs=syncs + 1 + (texts is not None), cache_bytes=cache_bytes(cache),
            num_generations=groups, decoder_start_id=self.decoder_start_id,
        )  # fmt: skip
