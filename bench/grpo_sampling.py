"""Reward training's sampling (train/core/reward/sampling.py) against transformers' generate() on the same
prompts, CPU, fp32; then the KV cache that sampling holds, predicted (kv_cache_bytes) and measured.

For each family and MODEL_SIZE (the registry's shapes, vocab 8192, dropout 0, a new model's weights): P
prompts of --prompt_length random tokens, G completions each (rows i*G .. i*G+G-1), MAX_COMPLETION_LENGTH
tokens, TEMPERATURE 1, no TOP_K / TOP_P. generate() gets the same left-padded prompts with
num_return_sequences G and the same seed in the global generator: it draws the same tokens as the
sampler's own generator, so both produce the same completions (checked) and the same count of tokens.
Figures: completion tokens per second, median of --repeats runs after one warm-up (per wall second and
per CPU second of the process); the aten ops each dispatches per token step, all rows (counted: the same
under any load); the prompt tokens each runs through the model; the sampler's host read-backs. Then the
KV cache's bytes: the sampler's real cache at the end against kv_cache_bytes for its rows and length, and
the term the plan will need at GRPO-sized shapes (PRECISION=bf16).

    .venv/bin/python bench/grpo_sampling.py [--cases gpt2:tiny,llama:small] [--prompts 4] [--generations 4]
        [--prompt_length 12 24] [--tokens 32] [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from train.core.reward.kv_cache import cache_dtype, kv_cache_bytes  # noqa: E402
from train.core.reward.sampling import Sampler, SamplingSettings, left_pad  # noqa: E402
from train.models import FAMILIES  # noqa: E402
from train.models.build import build_model  # noqa: E402
from train.models.family import set_dropout  # noqa: E402

VOCAB, EOS, PAD = 8192, 0, 0


def model_of(family: str, size: str):
    cfg = FAMILIES[family].config_for(size, VOCAB, EOS)
    set_dropout(cfg, 0.0)
    return build_model(cfg, gradient_checkpointing=False, seed=0).eval()


def prompts_of(n: int, shortest: int, longest: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(shortest, longest + 1, (n,), generator=g).tolist()
    return [torch.randint(1, VOCAB, (k,), generator=g).tolist() for k in lengths]


def run_sampler(model, prompts, settings, seed):
    # an encoder-decoder samples from its decoder start token; a causal LM has none
    start = model.config.decoder_start_token_id if model.config.is_encoder_decoder else None
    sampler = Sampler(settings, eos_ids=[EOS], pad_id=PAD, device="cpu", seed=seed, decoder_start_id=start)
    cpu = time.process_time()
    rollout = sampler.sample(model, prompts)
    cpu = time.process_time() - cpu
    return rollout.completion_ids, int(rollout.lengths.sum()), (rollout.seconds, cpu), rollout


def run_generate(model, prompts, settings, seed):
    ids, mask = left_pad(prompts, PAD, "cpu")
    torch.manual_seed(seed)
    start, cpu = time.perf_counter(), time.process_time()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True,
                             temperature=settings.temperature, top_k=0, top_p=1.0,
                             max_new_tokens=settings.max_completion_length,
                             num_return_sequences=settings.num_generations, eos_token_id=EOS,
                             pad_token_id=PAD, use_cache=True)  # fmt: skip
    seconds = (time.perf_counter() - start, time.process_time() - cpu)
    completions = out[:, 1:] if model.config.is_encoder_decoder else out[:, ids.shape[1]:]
    is_eos = completions == EOS
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, completions.shape[1])
    return completions, int(first.sum()), seconds


def aten_ops(fn) -> int:
    """Ops fn dispatches to aten (every kernel call on the CPU): host work, counted, not timed."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


def compare(family: str, size: str, args) -> dict:
    model = model_of(family, size)
    prompts = prompts_of(args.prompts, *args.prompt_length)
    settings = SamplingSettings(num_generations=args.generations, max_completion_length=args.tokens)
    rates, same = {"sampler": [], "generate": [], "sampler_cpu": [], "generate_cpu": []}, True
    for repeat in range(args.repeats + 1):
        ours, n_ours, s_ours, rollout = run_sampler(model, prompts, settings, seed=repeat)
        theirs, n_theirs, s_theirs = run_generate(model, prompts, settings, seed=repeat)
        width = ours.shape[1]
        same = same and n_ours == n_theirs and torch.equal(ours, theirs[:, :width].masked_fill(
            rollout.completion_mask == 0, PAD))  # fmt: skip
        if repeat:  # the first is the warm-up
            for name, n, (wall, cpu) in (("sampler", n_ours, s_ours), ("generate", n_theirs, s_theirs)):
                rates[name].append(n / wall)
                rates[f"{name}_cpu"].append(n / cpu)
    steps = ours.shape[1]  # tokens drawn per row: the same for both (checked)
    ops = {"ops_sampler": aten_ops(lambda: run_sampler(model, prompts, settings, 0)) / steps,
           "ops_generate": aten_ops(lambda: run_generate(model, prompts, settings, 0)) / steps}
    source = 0
    length = rollout.prompt_ids.shape[1] + args.tokens - 1
    if model.config.is_encoder_decoder:  # self-attention over the decoder's tokens, cross over the source
        source, length = rollout.prompt_ids.shape[1], args.tokens
    rows = args.prompts * args.generations
    return {"family": family, "size": size, "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
            **{name: statistics.median(values) for name, values in rates.items()}, **ops,
            "prompt_tokens": rollout.prompt_ids.shape[1] * args.prompts,
            # generate() runs a causal LM's prompt in each of its G rows; an encoder-decoder's encoder once
            "generate_prompt_tokens": rollout.prompt_ids.shape[1] * args.prompts * (
                1 if model.config.is_encoder_decoder else args.generations),
            "same": same, "syncs": rollout.host_syncs, "cache": rollout.cache_bytes,
            "estimate": kv_cache_bytes(model.config, rows, length, torch.float32, source)}  # fmt: skip


def plan_terms() -> None:
    print("\nKV cache the plan must hold for sampling, PRECISION=bf16 (kv_cache_bytes; rows = P*G):")
    print(f"{'family':7} {'size':6} {'rows':>5} {'prompt+completion':>18} {'dtype':>9} {'MiB':>9}")
    for family in ("gpt2", "llama", "t5"):
        for size in ("tiny", "small"):
            cfg = FAMILIES[family].config_for(size, VOCAB, EOS)
            dtype = cache_dtype(cfg, "bf16")  # float32 for the rotary families (kv_cache.py)
            for rows, prompt, completion in ((64, 256, 256), (128, 256, 768)):
                if cfg.is_encoder_decoder:
                    bytes_ = kv_cache_bytes(cfg, rows, completion, dtype, source_length=prompt)
                else:
                    bytes_ = kv_cache_bytes(cfg, rows, prompt + completion, dtype)
                name = str(dtype).removeprefix("torch.")
                shape = f"{prompt}+{completion}"
                print(f"{family:7} {size:6} {rows:5} {shape:>18} {name:>9} {bytes_ / 2**20:9.1f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--generations", type=int, default=4)
    p.add_argument("--tokens", type=int, default=32, help="MAX_COMPLETION_LENGTH")
    p.add_argument("--prompt_length", type=int, nargs=2, default=(12, 24), help="shortest and longest prompt")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cases", default="gpt2:tiny,gpt2:small,llama:tiny,t5:tiny")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"P={args.prompts} G={args.generations} prompts of {args.prompt_length[0]}-{args.prompt_length[1]} "
          f"tokens, MAX_COMPLETION_LENGTH={args.tokens}, CPU fp32, {args.threads} thread(s), median of "
          f"{args.repeats}; tok/s per wall second and per CPU second of the process (steadier on a shared "
          "machine); prompt tokens run: the sampler's (once per prompt) against generate's")
    print(f"{'family':7} {'size':6} {'params':>8} {'ours/s':>7} {'gen/s':>7} {'ours/cpu-s':>10} "
          f"{'gen/cpu-s':>10} {'ratio':>6} {'ops/step':>8} {'gen ops':>7} {'prompt tok':>11} {'same':>5} "
          f"{'syncs':>5} {'cache MiB':>10} {'estimate':>9}")
    for case in args.cases.split(","):
        family, size = case.split(":")
        r = compare(family, size, args)
        prompt_tokens = f"{r['prompt_tokens']}/{r['generate_prompt_tokens']}"
        ratio = r["sampler_cpu"] / r["generate_cpu"]
        print(f"{family:7} {size:6} {r['params_m']:7.1f}M {r['sampler']:7.1f} {r['generate']:7.1f} "
              f"{r['sampler_cpu']:10.1f} {r['generate_cpu']:10.1f} "
              f"{ratio:6.2f} {r['ops_sampler']:8.0f} {r['ops_generate']:7.0f} "
              f"{prompt_tokens:>11} {str(r['same']):>5} {r['syncs']:5} {r['cache'] / 2**20:10.2f} "
              f"{r['estimate'] / 2**20:9.2f}", flush=True)
    plan_terms()


if __name__ == "__main__":
    main()
