"""Preference training against TRL's DPOTrainer: the same model, pairs, batch, length, beta and
learning rate, one thread each, CPU, runs alternated (kit, TRL, kit, TRL ...) so both see the same
machine, the median of the pairs' ratios printed. TRL runs in a scratch venv (never the kit's):

    python3 -m venv /tmp/trlvenv && /tmp/trlvenv/bin/pip install torch==2.13.0 transformers==5.23.0
    trl==1.16.0 .venv/bin/python bench/dpo_vs_trl.py --trl-python /tmp/trlvenv/bin/python [--model
    runs/x/final] [--repeat 3]

Without --model a nano GPT-2 is pretrained for 2 steps first (its weights do not matter for speed).
Both sides train on the same token sequences: prompt + eos, then the reply + eos (the kit's
TEMPLATE=none; bench/dpo_trl_side.py gives TRL's prompt the eos), MAX_LENGTH long enough that no pair
is cut on either side, each batch padded to its longest row, REFERENCE=copy as TRL's default (a frozen
copy of the policy), fp32, no gradient checkpointing, dropout off, fused AdamW, a log line every step.

Both sides are clocked the same way: a stamp at the end of each optimizer step (the kit's step line,
read here as it is printed; TRL's on_step_end), the first --skip steps left out. Each stamp has the
wall clock and the process's CPU time (/proc/PID/stat for the kit, time.process_time for TRL): on a
shared host the wall figures move with the other tenants' load, the CPU-time ones far less. Tokens are
real ones (attention_mask), the prompt counted in both rows of its pair. Each side prints its
torch.get_num_threads() (the kit's from an exit hook in the same process).

--profile: torch.profiler tables of steps 3-4 of each side (TRL also with its own CPU defaults,
bf16 and gradient checkpointing) instead of the timed pairs. --trl-compact-head: a diagnostic,
TRL's LM head on the response positions only, as TRL runs it where Triton runs (CUDA, XPU); on a
CPU TRL scores every position. Results: bench/RESULTS.md, "Preference training against TRL".
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KIT = Path(__file__).resolve().parent.parent
WORDS = ("the quick brown fox jumps over a lazy dog while seven wise kings of old sang songs about rivers "
         "mountains bread wine summer winter light darkness and every small thing under heaven").split()
TICK = os.sysconf("SC_CLK_TCK")
# the kit in this process's place, printing its thread count when it exits (train/ itself never sets it)
KIT_MAIN = ("import atexit, runpy, sys, torch; atexit.register(lambda: print('threads', "
            "torch.get_num_threads(), "
            "flush=True)); sys.argv[0] = 'train'; runpy.run_module('train', run_name='__main__', "
            "alter_sys=True)")
# the same, with torch.profiler over optimizer steps 3 and 4 (a global optimizer-step hook: the loop is
# unchanged)
KIT_PROFILE = """
import atexit, os, runpy, sys, torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.profiler import ProfilerActivity, profile
prof, steps = profile(activities=[ProfilerActivity.CPU]), [0]
def hook(opt, args, kwargs):
    steps[0] += 1
    if steps[0] == 2:
        prof.__enter__()
    elif steps[0] == 4:
        prof.__exit__(None, None, None)
        with open(os.environ["KIT_PROFILE"], "w") as f:
            f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
register_optimizer_step_post_hook(hook)
sys.argv[0] = "train"
runpy.run_module("train", run_name="__main__", alter_sys=True)
"""


def write_pairs(path: Path, n: int = 512) -> None:
    rng = random.Random(0)

    def words(k):
        return " ".join(rng.choice(WORDS) for _ in range(k))

    with path.open("w") as f:
        for _ in range(n):  # replies start with a space: the prompt ends on a token boundary for TRL
            f.write(json.dumps({"prompt": "Say something about " + words(rng.randint(10, 30)),
                                "chosen": " " + words(rng.randint(15, 35)),
                                "rejected": " " + words(rng.randint(15, 35))}) + "\n")


def env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                PYTHONUNBUFFERED="1")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def steady(wall: list, cpu: list, tokens: list, a) -> dict:
    """Figures over steps skip+1..N from per-step end stamps and per-step real tokens."""
    k = a.skip - 1  # stamp of the last skipped step
    n = len(wall) - 1 - k
    span_wall, span_cpu, toks = wall[-1] - wall[k], cpu[-1] - cpu[k], sum(tokens[a.skip:])
    return {"steps": n, "pairs_s": a.batch * n / span_wall, "tokens_s": toks / span_wall,
            "cpu_pairs_s": a.batch * n / span_cpu, "cpu_tokens_s": toks / span_cpu,
            "cpu_share": span_cpu / span_wall, "tokens_per_pair": toks / (a.batch * n)}


def kit_argv(work: Path, model: str, pairs: Path, a, i: int, main: str = KIT_MAIN) -> list[str]:
    return [
        sys.executable,
        "-c",
        main,
        "dpo",
        "--model_path",
        model,
        "--data_path",
        str(pairs),
        "--batch_size",
        str(a.batch),
        "--gradient_accumulation_steps",
        "1",
        "--max_length",
        str(a.max_length),
        "--max_steps",
        str(a.steps),
        "--beta",
        "0.1",
        "--learning_rate",
        "1e-5",
        "--lr_schedule",
        "constant",
        "--warmup_steps",
        "0",
        "--template",
        "none",
        "--reference",
        "copy",
        "--num_workers",
        "0",
        "--val_fraction",
        "0",
        "--output_dir",
        str(work / "runs"),
        "--run_name",
        f"kit{i}",
        "--cache_dir",
        str(work / "cache"),
        "--log_every",
        "1",
        "--overwrite",
        "1",
    ]


def kit_run(work: Path, model: str, pairs: Path, a, i: int) -> dict:
    argv = kit_argv(work, model, pairs, a, i)
    proc = subprocess.Popen(
        argv, cwd=KIT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    wall, cpu, lines, threads = [], [], [], None
    for line in proc.stdout:
        if re.match(r"step \d+/\d+ ", line):
            wall.append(time.perf_counter())
            cpu.append(cpu_seconds(proc.pid))
        threads = int(line.split()[1]) if line.startswith("threads ") else threads
        lines.append(line)
    if proc.wait() or len(wall) != a.steps:
        sys.exit("kit run failed:\n" + "".join(lines[-40:]))
    run = work / "runs" / f"kit{i}"
    summary = json.loads((run / "summary.json").read_text())
    if summary["n_truncated"] or summary["n_reply_cut"]:
        sys.exit(f"the kit cut {summary['n_truncated']} pairs at --max_length {a.max_length}: raise it")
    cum = [0] + [json.loads(r)["tokens"] for r in (run / "metrics.jsonl").read_text().splitlines()]
    tokens = [b - c for b, c in zip(cum[1:], cum[:-1], strict=True)]
    return {**steady(wall, cpu, tokens, a), "threads": threads, "padding": summary["padding_efficiency"]}


def trl_run(trl_python: str, model: str, pairs: Path, a, work: Path) -> dict:
    argv = [trl_python, str(KIT / "bench" / "dpo_trl_side.py"), model, str(pairs), "--batch", str(a.batch),
            "--max_length", str(a.max_length), "--steps", str(a.steps), "--out", str(work / "trl"),
            *(["--compact-head"] if a.trl_compact_head else [])]
    done = subprocess.run(argv, env=env(), capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"TRL run failed:\n{done.stderr[-3000:]}")
    got = json.loads(done.stdout.strip().splitlines()[-1])
    if got["cut_pairs"]:
        sys.exit(f"TRL cut {got['cut_pairs']} pairs at --max_length {a.max_length}: raise it")
    padding = sum(got["tokens"]) / sum(2 * a.batch * n for n in got["longest"])  # each batch: its longest row
    return {
        **steady(got["wall"], got["cpu"], got["tokens"], a),
        "threads": got["threads"],
        "padding": padding,
    }


def profile(work: Path, model: str, pairs: Path, a) -> None:
    """Each side's steps 3 and 4 under torch.profiler, the top ops by self CPU time, into WORK/profile_*.txt
    (TRL twice: as set here, and with its own bf16 and gradient-checkpointing defaults)."""
    a.steps = 4
    kit = work / "profile_kit.txt"
    subprocess.run(
        kit_argv(work, model, pairs, a, 99, KIT_PROFILE),
        cwd=KIT,
        env={**env(), "KIT_PROFILE": str(kit)},
        check=True,
        capture_output=True,
    )
    side = [a.trl_python, str(KIT / "bench" / "dpo_trl_side.py"), model, str(pairs), "--batch", str(a.batch),
            "--max_length", str(a.max_length), "--out", str(work / "trl")]
    for name, extra in (("profile_trl.txt", []), ("profile_trl_defaults.txt", ["--trl-defaults"])):
        subprocess.run(
            [*side, "--profile", str(work / name), *extra], env=env(), check=True, capture_output=True
        )
    for name in ("profile_kit.txt", "profile_trl.txt", "profile_trl_defaults.txt"):
        print(f"== {name}\n" + (work / name).read_text())


def show(side: str, r: dict) -> str:
    return (f"{side} {r['pairs_s']:.2f} pairs/s {r['tokens_s']:.0f} tok/s (CPU time: {r['cpu_pairs_s']:.2f} "
            f"pairs/s "
            f"{r['cpu_tokens_s']:.0f} tok/s, {r['cpu_share']:.0%} of a core, {r['tokens_per_pair']:.1f} "
            f"tok/pair, {r['padding']:.0%} real, {r['threads']} thread)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trl-python", required=True, help="a python with trl 1.16 (a scratch venv)")
    p.add_argument("--model", help="a causal-LM folder with its tokenizer (default: a nano GPT-2, 2 steps)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max_length", type=int, default=192, help="long enough that no pair is cut")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--skip", type=int, default=2, help="first steps left out of the figures")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="torch.profiler tables of steps 3-4 of each side "
                                                          "instead")
    p.add_argument("--trl-compact-head", action="store_true",
                   help="diagnostic: TRL's LM head on response positions only, as it runs on CUDA/XPU (not "
                        "on a CPU)")
    p.add_argument("--work", help="a folder for the pairs, model and runs (default: a new temporary one)")
    a = p.parse_args()
    work = Path(a.work or tempfile.mkdtemp(prefix="dpo-vs-trl-"))
    work.mkdir(parents=True, exist_ok=True)
    pairs = work / "pairs.jsonl"
    write_pairs(pairs)
    model = a.model
    if model is None:
        model = work / "runs" / "base" / "final"
        if not model.is_dir():
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "train",
                    "pretrain",
                    "--model_size",
                    "nano",
                    "--max_steps",
                    "2",
                    "--output_dir",
                    str(work / "runs"),
                    "--run_name",
                    "base",
                    "--cache_dir",
                    str(work / "cache"),
                ],
                cwd=KIT,
                env=env(),
                check=True,
                capture_output=True,
            )
        model = str(model)
    if a.profile:
        return profile(work, model, pairs, a)
    rows = []
    for i in range(a.repeat):
        kit = kit_run(work, model, pairs, a, i)
        trl = trl_run(a.trl_python, model, pairs, a, work)
        rows.append((kit, trl))
        print(f"pair {i + 1}: {show('kit', kit)}\n        {show('TRL', trl)}\n        kit/TRL tokens/s "
              f"{kit['tokens_s'] / trl['tokens_s']:.2f}x wall, "
              f"{kit['cpu_tokens_s'] / trl['cpu_tokens_s']:.2f}x "
              f"CPU time; pairs/s {kit['pairs_s'] / trl['pairs_s']:.2f}x wall", flush=True)
    for key, name in (("tokens_s", "tokens/s, wall"), ("cpu_tokens_s", "tokens/s, CPU time"),
                      ("pairs_s", "pairs/s, wall"), ("cpu_pairs_s", "pairs/s, CPU time")):
        ratios = sorted(k[key] / t[key] for k, t in rows)
        print(f"median of {a.repeat} pairs, kit / TRL {name}: {statistics.median(ratios):.2f}x "
              f"(range {ratios[0]:.2f}-{ratios[-1]:.2f})")
    print(f"(batch {a.batch} pairs, max_length {a.max_length}, {a.steps} steps of which the first {a.skip} "
          f"left out, 1 thread, fp32, REFERENCE=copy)")


if __name__ == "__main__":
    main()
