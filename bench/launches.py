"""Kernel launches per optimizer step, eager against compiled, on the kit's paths: pretraining, SFT
(length buckets), DPO, T5 pretraining (span corruption) and T5 SFT. Each is the real run
(`python -m train ...`, the launchers' code), one optimizer step traced with torch.profiler by
train/tools/step_profile.py's hook; eager is COMPILE=0, compiled is COMPILE=1 with inductor, what an
empty COMPILE now gives on a GPU (before: eager for SFT, DPO and T5 SFT).

A launch here is an op that does work on the device, counted from the trace: an aten op that is no
view or metadata change (as_strided, view, t, expand, empty ...) and is not called from inside
another such op (aten::linear's addmm counts, linear itself does not), plus every kernel
inductor generated (its C++ kernels, named in the trace with cpp.enable_kernel_profile). On a GPU
each is at least one kernel launch, and each is host time between kernels when the kernels are
short. matmuls: the counted aten mm / addmm / bmm / baddbmm (inductor leaves matmuls to the
library, so they stay launches when compiled). CUDA graphs (COMPILE_MODE=reduce-overhead) need a
GPU: there (`--modes eager,compiled,graphs` on a CUDA machine) the table adds the host's launch
calls of the step (cudaLaunchKernel, cudaGraphLaunch, async copies and sets in the trace), where a
graph's replay is one call.

    .venv/bin/python bench/launches.py                       # every path, eager and compiled
    .venv/bin/python bench/launches.py --paths sft,dpo --modes eager

The models are tiny (2 layers, width 64): the count grows with the layers, not the width, so a
12-layer model launches about 6x as many per layer-bound op; the figures compare eager with
compiled, not models. One thread; the collator runs in a DataLoader worker, outside the trace.
Everything is made offline in --work (default /tmp/kit-launches).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CORPUS = Path("/work/shared/data/tinyshakespeare.txt")
GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 2, "n_positions": 256}
T5 = {
    "model_type": "t5",
    "d_model": 64,
    "d_ff": 128,
    "num_layers": 2,
    "num_decoder_layers": 2,
    "num_heads": 2,
    "d_kv": 32,
    "dropout_rate": 0.0,
    "feed_forward_proj": "relu",
    "tie_word_embeddings": True,
}
STEP = 4  # the traced optimizer step (0-based): after the compile trial, step 0 and the sync probe's step 2
COMMON = [
    "--max_steps",
    "6",
    "--log_every",
    "100",
    "--val_fraction",
    "0",
    "--save_every",
    "0",
    "--num_workers",
    "1",
    "--max_length",
    "64",
    "--batch_size",
    "4",
    "--seed",
    "1",
]
MODES = {"eager": ["--compile", "0"], "compiled": ["--compile", "1", "--compile_mode", "default"],
         "graphs": ["--compile", "1", "--compile_mode", "reduce-overhead"]}  # graphs: CUDA only
# on a GPU: the host's launch calls themselves (a CUDA graph's replay is one cudaGraphLaunch)
RUNTIME_LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                    "cudaGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync")
# aten ops that change no data: views, metadata, allocation (no kernel on a GPU)
NO_WORK = {
    "as_strided",
    "view",
    "_unsafe_view",
    "_reshape_alias",
    "reshape",
    "t",
    "transpose",
    "permute",
    "expand",
    "expand_as",
    "unsqueeze",
    "squeeze",
    "slice",
    "select",
    "alias",
    "detach",
    "detach_",
    "resolve_conj",
    "resolve_neg",
    "empty",
    "empty_strided",
    "empty_like",
    "lift_fresh",
    "split",
    "split_with_sizes",
    "chunk",
    "unbind",
    "narrow",
    "view_as",
    "flatten",
    "unflatten",
    "contiguous",
    "to",
    "linear",
    "matmul",
    "numpy_T",
    "_has_compatible_shallow_copy_type",
    "is_nonzero",
    "size",
    "stride",
    "dim",
    "result_type",
    "_local_scalar_dense",
    "item",
    "set_",
    "unfold",
    "diagonal",
    "movedim",
    "swapaxes",
    "type_as",
    "dropout",
    "scaled_dot_product_attention",
    "cross_entropy_loss",
    "layer_norm",
    "softmax",
    "log_softmax",
    "embedding_backward",
    "real",
    "imag",
}
MATMULS = {"mm", "addmm", "bmm", "baddbmm"}


def does_work(name: str) -> bool:
    if name.startswith("graph_") and "cpp_fused" in name:  # an inductor kernel
        return True
    if not name.startswith(("aten::", "mkldnn::")):
        return False
    return name.split("::", 1)[1].split(".")[0] not in NO_WORK


def count(events) -> dict:
    """(launches, matmuls) of a profiler trace: working ops not called from inside a working op."""
    launches = matmuls = runtime = 0
    for e in events:
        runtime += e.name in RUNTIME_LAUNCHES
        if not does_work(e.name):
            continue
        parent = e.cpu_parent
        while parent is not None and not does_work(parent.name):
            parent = parent.cpu_parent
        if parent is None:
            launches += 1
            matmuls += e.name.split("::", 1)[-1] in MATMULS
    return {
        "launches": launches,
        "matmuls": matmuls,
        "cuda_launch_calls": runtime if torch.cuda.is_available() else None,
    }


def one(argv: list[str]) -> int:
    """In a child process: the run, its step traced; prints the counts as JSON."""
    torch.set_num_threads(1)
    torch._inductor.config.cpp.enable_kernel_profile = True  # inductor's kernels named in the trace
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from train.tools.step_profile import OneStep, run

    hook = OneStep(STEP)
    handle = register_optimizer_step_post_hook(hook)
    try:
        code = run(argv[0], argv[1:])
    finally:
        handle.remove()
    if code != 0 or hook.result is None:
        return code or 1
    out = Path(argv[argv.index("--output_dir") + 1]) / argv[argv.index("--run_name") + 1]
    summary = json.loads((out / "summary.json").read_text())
    print(
        "LAUNCHES "
        + json.dumps(
            {
                **count(hook.prof.events()),
                "step_ms": hook.result["step_ms"],
                "compiled_in_step": hook.result["compiled_during_step"],
                "compile": summary["compile"],
                "host_syncs_per_step": summary["host_syncs_per_step"],
            }
        )
    )
    return 0


def child(args: list[str]) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run(
        [sys.executable, __file__, "--one", *args], cwd=ROOT, env=env, capture_output=True, text=True
    )
    found = [line for line in proc.stdout.splitlines() if line.startswith("LAUNCHES ")]
    if proc.returncode != 0 or not found:
        raise SystemExit(f"error: {' '.join(args)} exited "
                         f"{proc.returncode}:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    return json.loads(found[-1][len("LAUNCHES "):])


def prepare(work: Path) -> dict:
    """The corpus, conversations, pairs, and the two base models SFT and DPO start from."""
    work.mkdir(parents=True, exist_ok=True)
    corpus = work / "corpus.txt"
    if not corpus.exists():
        corpus.write_text(
            CORPUS.read_text()[:400_000] if CORPUS.exists() else "the quick brown fox. " * 20000
        )
    for name, config in (("gpt2.json", GPT2), ("t5.json", T5)):
        (work / name).write_text(json.dumps(config))
    sft = work / "sft.jsonl"
    sft.write_text(
        "".join(
            json.dumps({"prompt": f"Item {i}: what next?", "response": "the quick fox " * (1 + i * 7 % 15)})
            + "\n"
            for i in range(400)
        )
    )
    pairs = work / "pairs.jsonl"
    pairs.write_text(
        "".join(
            json.dumps(
                {
                    "prompt": f"Say {i}.",
                    "chosen": f"{i} " * (1 + i % 9),
                    "rejected": f"no {i % 5} way " * (1 + i % 4),
                }
            )
            + "\n"
            for i in range(200)
        )
    )
    flags = {
        "data": ["--data_path", str(corpus), "--vocab_size", "512", "--cache_dir", str(work / "cache")],
        "sft": ["--data_path", str(sft), "--cache_dir", str(work / "cache"), "--tokenize_workers", "1"],
        "pairs": ["--data_path", str(pairs), "--cache_dir", str(work / "cache"), "--tokenize_workers", "1"],
    }
    for family in ("gpt2", "t5"):  # the base models, trained two steps eager
        if not (work / "runs" / f"base-{family}" / "final").is_dir():
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "train",
                    "pretrain",
                    "--model_config",
                    str(work / f"{family}.json"),
                    *flags["data"],
                    "--max_length",
                    "64",
                    "--batch_size",
                    "4",
                    "--max_steps",
                    "2",
                    "--output_dir",
                    str(work / "runs"),
                    "--run_name",
                    f"base-{family}",
                    "--compile",
                    "0",
                    "--overwrite",
                    "1",
                ],
                cwd=ROOT,
                check=True,
                capture_output=True,
                env=dict(os.environ, OMP_NUM_THREADS="1"),
            )
    return flags


def paths(work: Path, flags: dict) -> dict:
    base = {f: ["--model_path", str(work / "runs" / f"base-{f}" / "final")] for f in ("gpt2", "t5")}
    return {
        "pretrain": ["pretrain", "--model_config", str(work / "gpt2.json"), *flags["data"]],
        "sft": ["sft", *base["gpt2"], *flags["sft"]],
        "dpo": ["dpo", *base["gpt2"], *flags["pairs"], "--reference", "copy"],
        "t5_pretrain": ["pretrain", "--model_config", str(work / "t5.json"), *flags["data"]],
        "t5_sft": ["sft", *base["t5"], *flags["sft"]],
    }


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        return one(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--paths", default="pretrain,sft,dpo,t5_pretrain,t5_sft")
    parser.add_argument("--modes", default="eager,compiled")
    parser.add_argument("--work", default="/tmp/kit-launches")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    work = Path(args.work)
    table = paths(work, prepare(work))
    rows = []
    print("| path | mode | launches / step | matmuls | CUDA launch calls | graphs | recompiles | graph "
          "breaks | host syncs / step |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.paths.split(","):
        for mode in args.modes.split(","):
            run_args = [*table[name], *COMMON, *MODES[mode], "--output_dir", str(work / "runs"),
                        "--run_name", f"{name}-{mode}", "--overwrite", "1"]  # fmt: skip
            r = {"path": name, "mode": mode, **child(run_args)}
            c = r["compile"]
            rows.append(r)
            calls = "-" if r["cuda_launch_calls"] is None else r["cuda_launch_calls"]
            print(f"| {name} | {mode} | {r['launches']} | {r['matmuls']} | {calls} | "
                  f"{c['graphs'] if c['enabled'] else '-'} | "
                  f"{c['recompiles'] if c['enabled'] else '-'} | "
                  f"{c['graph_breaks'] if c['enabled'] else '-'} | "
                  f"{r['host_syncs_per_step']} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
