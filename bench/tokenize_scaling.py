"""Tokenizing on every core: the token cache's build rate against one core's, on the same corpus.

    python bench/tokenize_scaling.py [--mb 1000] [--work .cache/bench] [--prepare] [--json FILE]

In this one run, on this one machine (made for the GPU machine's 16 cores, where the GPU is idle):
- one core: the kit's own encode path (tokenize.encode_pieces, the tokenizer's encode_batch with
  its threads off, as each worker runs it) over the first units of the corpus, in a process
  pinned to one core: tokens/s per core;
- every core: the whole token cache build of the corpus (train/data/token_shards.py, one
  TOKENIZE_WORKERS process per core, pool start, shard writes and checksums included) in a
  child process, its resident memory (main process, and with its workers) sampled every 0.2 s,
  first on a prefix of the corpus (a tenth) and then on the whole of it: memory flat means the
  two peaks are alike;
- the machine's ceiling: the same one-core encode in one pinned process per core, all at once,
  nothing shared: where the cores are hyperthreads, or one busy core runs at a higher clock than
  all of them together, this is under cores x one core, and no build can pass it;
- efficiency = every-core tokens/s / (cores x one core's tokens/s), and against the ceiling.
The corpus is bench/data_pretrain.py's (short documents of standard-library lines, JSONL, made
offline); --prepare only makes the corpus and tokenizer (run it beside other work). Writes the
section "Tokenizing on every core" of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
SECTION = "## Tokenizing on every core (bench/tokenize_scaling.py)"
TARGET = 0.9


def prepare(work: Path, mb: int) -> tuple[Path, Path, Path]:
    """(corpus, its first tenth, tokenizer folder), made once."""
    import data_pretrain

    work.mkdir(parents=True, exist_ok=True)
    tokenizer = data_pretrain.make_tokenizer(work / "tokenizer")
    corpus = work / f"corpus-{mb}mb.jsonl"
    data_pretrain.make_jsonl(corpus, mb)
    prefix = work / f"corpus-{mb}mb-tenth.jsonl"
    if not prefix.exists():
        want = corpus.stat().st_size // 10
        with open(corpus, "rb") as src, open(prefix.with_suffix(".tmp"), "wb") as out:
            out.write(src.read(want) + src.readline())  # ends on a whole line
        os.replace(prefix.with_suffix(".tmp"), prefix)
    return corpus, prefix, tokenizer


def one_core(corpus: Path, tokenizer: Path, units: int, core: int = 0) -> dict:
    """Child process: pinned to one core, the workers' own encode over the first `units` units."""
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[core]})
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    import itertools

    import numpy as np

    from train.data import tokenize

    tok_json = (tokenizer / "tokenizer.json").read_text()
    backend = tokenize.backend_of_json(tok_json)
    eos = backend.token_to_id("<|endoftext|>")
    eos = 0 if eos is None else eos
    todo = list(itertools.islice(tokenize.iter_units([corpus], "text"), units))
    began, tokens, size = time.perf_counter(), 0, 0
    for _, unit, n in todo:
        tokens += len(tokenize.encode_pieces(backend, tokenize.unit_pieces(unit), eos, np.dtype(np.uint16)))
        size += n
    seconds = time.perf_counter() - began
    return {"tokens": tokens, "mb": size / 1e6, "seconds": seconds, "tokens_per_s": tokens / seconds}


def all_alone(corpus: Path, tokenizer: Path, units: int, work: Path) -> dict:
    """The machine's own ceiling: one_core's encode in one process per core, all at once, each
    pinned to its core, nothing shared (no pool, no main process, no writes). Where cores are
    hyperthreads or one core alone runs at a higher clock, this is below cores x one core."""
    cores = len(os.sched_getaffinity(0))
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--child",
                "one",
                str(corpus),
                str(tokenizer),
                str(units),
                str(core),
                str(work / f"alone-{core}.json"),
            ],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        for core in range(cores)
    ]
    if any(p.wait() != 0 for p in procs):
        raise SystemExit("tokenize_scaling: a one-core child failed")
    results = [json.loads((work / f"alone-{core}.json").read_text()) for core in range(cores)]
    tokens = sum(r["tokens"] for r in results)
    seconds = max(r["seconds"] for r in results)  # each timed its own encode, after its start-up
    return {"workers": cores, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "mb": sum(r["mb"] for r in results)}  # fmt: skip


def build(corpus: Path, tokenizer: Path, cache: Path) -> dict:
    """Child process: the kit's whole token cache build on every core (bench/data_pretrain.py's)."""
    import data_pretrain

    from train.data import tokenize

    return {**data_pretrain.kit_build(corpus, tokenizer, cache), "workers": tokenize.all_cores(),
            "mb": corpus.stat().st_size / 1e6}  # fmt: skip


def child(kind: str, *args: str) -> dict:
    """Runs `kind` in a fresh process, sampling its resident memory: (result, peak main, peak all)."""
    from data_pretrain import tree_rss_mb

    out = Path(args[-1])
    argv = [sys.executable, __file__, "--child", kind, *args]
    proc = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    peak_main = peak_all = 0.0
    while proc.poll() is None:
        main, whole = tree_rss_mb(proc.pid)
        peak_main, peak_all = max(peak_main, main), max(peak_all, whole)
        time.sleep(0.2)
    if proc.returncode != 0:
        raise SystemExit(f"tokenize_scaling: the {kind} child failed (exit {proc.returncode})")
    result = json.loads(out.read_text())
    result.update(peak_main_mb=peak_main, peak_all_mb=peak_all)
    return result


def section(r: dict, note: str) -> str:
    import data_pretrain

    one, small, big, alone = r["one_core"], r["tenth"], r["whole"], r["alone"]
    ideal = big["workers"] * one["tokens_per_s"]
    eff = big["tokens_per_s"] / ideal
    verdict = "met" if eff >= TARGET else f"missed by {100 * (TARGET - eff):.0f} points"
    lines = [
        SECTION, "",
        f"**{data_pretrain.device()}**, {time.strftime('%Y-%m-%d')}{', ' + note if note else ''}. One core: "
        f"the workers' own encode (encode_batch, its threads off) over the corpus's first units in a process "
        "pinned to one core. Every core: the whole token cache build (pool start, shard writes, checksums "
        "included), one TOKENIZE_WORKERS process per core; peak resident memory sampled every 0.2 s.", "",
        "| corpus | MB | tokens | workers | tokens/s | x one core | efficiency (target >= 90%) | seconds | "
        "peak RSS: main (all processes) |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| one core, first units | {one['mb']:,.0f} | {one['tokens']:,} | 1 | {one['tokens_per_s']:,.0f} | "
        f"1.00 | | {one['seconds']:.1f} | {one['peak_main_mb']:,.0f} MB |",
    ]
    x = alone["tokens_per_s"] / one["tokens_per_s"]
    lines.append(f"| one process per core, nothing shared (the machine's ceiling) | {alone['mb']:,.0f} | "
                 f"{alone['tokens']:,} | {alone['workers']} | {alone['tokens_per_s']:,.0f} | {x:.2f} | "
                 f"{100 * x / alone['workers']:.0f}% | {alone['seconds']:.1f} | |")
    for name, row in (("first tenth", small), ("whole corpus", big)):
        x = row["tokens_per_s"] / one["tokens_per_s"]
        lines.append(f"| {name} | {row['mb']:,.0f} | {row['tokens']:,} | {row['workers']} | "
                     f"{row['tokens_per_s']:,.0f} | {x:.2f} | {100 * x / row['workers']:.0f}% | "
                     f"{row['seconds']:.1f} | {row['peak_main_mb']:,.0f} MB ({row['peak_all_mb']:,.0f} MB) |")
    lines += ["", f"Target (>= 90% of {big['workers']} x one core on the whole corpus): **{verdict}** "
              f"({100 * eff:.0f}%); against the machine's own ceiling (one process per core, nothing shared) "
              f"{100 * big['tokens_per_s'] / alone['tokens_per_s']:.0f}%. Main-process peak "
              f"{small['peak_main_mb']:,.0f} MB at a tenth, "
              f"{big['peak_main_mb']:,.0f} MB at the whole corpus."]
    return "\n".join(lines) + "\n"


def write_results(new: str) -> None:
    path = ROOT / "bench" / "RESULTS.md"
    text = path.read_text()
    start = text.find(SECTION)
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + new
    else:
        end = text.find("\n## ", start + len(SECTION))
        text = text[:start] + new + (text[end + 1:] if end >= 0 else "")
    path.write_text(text)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        kind, *args = sys.argv[2:]
        if kind == "one":
            result = one_core(
                Path(args[0]), Path(args[1]), int(args[2]), int(args[3]) if len(args) > 4 else 0
            )
        else:
            result = build(Path(args[0]), Path(args[1]), Path(args[2]))
        Path(args[-1]).write_text(json.dumps(result))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=1000, help="corpus size in MB")
    parser.add_argument("--work", default=str(ROOT / ".cache" / "bench"))
    parser.add_argument("--units", type=int, default=40, help="units (~1 MB each) for the one-core rate")
    parser.add_argument("--prepare", action="store_true", help="only make the corpus and tokenizer")
    parser.add_argument("--json", default="", help="also write the figures here")
    parser.add_argument("--note", default="")
    args = parser.parse_args()
    work = Path(args.work)
    corpus, tenth, tokenizer = prepare(work, args.mb)
    if args.prepare:
        print(f"tokenize_scaling: {corpus} and {tokenizer} ready")
        return
    r = {"one_core": child("one", str(corpus), str(tokenizer), str(args.units), str(work / "one.json"))}
    print(f"one core: {r['one_core']['tokens_per_s']:,.0f} tokens/s", flush=True)
    r["alone"] = all_alone(corpus, tokenizer, max(4, args.units // 4), work)
    print(f"one process per core, nothing shared: {r['alone']['tokens_per_s']:,.0f} tokens/s", flush=True)
    for name, path in (("tenth", tenth), ("whole", corpus)):
        r[name] = child(
            "build", str(path), str(tokenizer), str(work / "scaling-cache"), str(work / f"{name}.json")
        )
        print(f"{name}: {r[name]['tokens_per_s']:,.0f} tokens/s on {r[name]['workers']} workers, "
              f"{r[name]['seconds']:.1f} s, peak main {r[name]['peak_main_mb']:,.0f} MB", flush=True)
    new = section(r, args.note)
    write_results(new)
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1))
    print(new)


if __name__ == "__main__":
    main()
