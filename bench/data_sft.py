"""SFT start-up at size: cold start (no SFT cache) and warm start (the cache built) to the first
optimizer step, with the peak RSS of the training process, on generated alpaca-style data.

    python bench/data_sft.py                       # 100k and 1M rows, JSONL and parquet
    python bench/data_sft.py --rows 100000 --formats jsonl --no-write
    make bench-data                                # bench/bench_data.sh runs it after pretraining's bench

Everything is made here, offline: the rows (instruction / input / output of ~900 bytes, words
drawn from a fixed list with a fixed seed, so every run benches the same bytes) and the model, a
nano GPT-2 from a one-step pretraining run on text drawn the same way (vocab 8192). Each case runs
`python -m train sft --max_steps 1` as a user would, times it until the console prints step 1,
and reads the process's own peak RSS from wait4 (the tokenizing workers are separate processes
and not counted: they share the parent's pages and exit when the cache is written). The table is
printed and written into bench/RESULTS.md under "SFT start-up", with the device and the date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORDS = (
    "the of and to in is that for it as with was on be by this are from at or an which not have function "
    "value "
    "list string number return data model train token batch memory loss step python file write read print "
    "error "
    "class object method call result example question answer explain simple small large fast slow first "
    "second next last input output order sort search tree graph node edge path"
).split()
SECTION = "## SFT start-up: cold and warm cache"


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def alpaca_rows(n: int, seed: int = 0):
    """n alpaca records of about 900 bytes each (40 % with an input), deterministic."""
    rng = random.Random(seed)
    for _ in range(n):
        yield {
            "instruction": _sentence(rng, rng.randint(8, 25)),
            "input": _sentence(rng, rng.randint(10, 40)) if rng.random() < 0.4 else "",
            "output": " ".join(_sentence(rng, rng.randint(8, 20)) for _ in range(rng.randint(3, 16))),
        }


def write_data(folder: Path, n: int) -> dict[str, Path]:
    """alpaca-<n>.jsonl and alpaca-<n>.parquet (the same rows), made once and kept."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl, parquet = folder / f"alpaca-{n}.jsonl", folder / f"alpaca-{n}.parquet"
    if not (jsonl.exists() and parquet.exists()):
        batch, writer = [], None
        with open(f"{jsonl}.tmp", "w") as out:
            for row in alpaca_rows(n):
                out.write(json.dumps(row) + "\n")
                batch.append(row)
                if len(batch) == 10_000:
                    table = pa.Table.from_pylist(batch)
                    writer = writer or pq.ParquetWriter(f"{parquet}.tmp", table.schema)
                    writer.write_table(table)
                    batch = []
        if batch:
            table = pa.Table.from_pylist(batch)
            writer = writer or pq.ParquetWriter(f"{parquet}.tmp", table.schema)
            writer.write_table(table)
        writer.close()
        os.replace(f"{jsonl}.tmp", jsonl)
        os.replace(f"{parquet}.tmp", parquet)
    return {"jsonl": jsonl, "parquet": parquet}


def cpu_seconds(pid: int) -> float | None:
    """CPU time of a live process and of the children it has waited for (its tokenizing
    workers), from /proc: on a shared machine the wall clock measures the neighbours too."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # utime stime cutime cstime


def run_kit(args: list[str], env: dict) -> tuple[float | None, float | None, float]:
    """(seconds to the first step or None, CPU seconds to it, peak RSS in MB) of one
    `python -m train` process."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "train", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    first, cpu, tail = None, None, []
    for line in proc.stdout:
        tail = (tail + [line])[-5:]
        if first is None and line.startswith("step 1/"):
            first, cpu = time.perf_counter() - start, cpu_seconds(proc.pid)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(
            f"error: python -m train {' '.join(args)} exited {proc.returncode}:\n{''.join(tail)}"
        )
    return first, cpu, usage.ru_maxrss / 1024


def base_model(work: Path, env: dict) -> Path:
    """A nano model from a one-step pretraining run (vocab 8192), made once."""
    final = work / "runs" / "base" / "final"
    if not (final / "config.json").exists():
        text = work / "pretrain.txt"
        text.write_text("\n".join(r["instruction"] + " " + r["output"] for r in alpaca_rows(3000, seed=1)))
        run_kit(
            [
                "pretrain",
                "--model_size",
                "nano",
                "--data_path",
                str(text),
                "--max_steps",
                "1",
                "--batch_size",
                "2",
                "--max_length",
                "128",
                "--output_dir",
                str(work / "runs"),
                "--run_name",
                "base",
                "--overwrite",
                "1",
                "--cache_dir",
                str(work / "cache"),
            ],
            env,
        )
    return final


def device() -> str:
    cpu = (
        next(
            (
                line.split(":", 1)[1].strip()
                for line in open("/proc/cpuinfo")
                if line.startswith("model name")
            ),
            platform.processor(),
        )
        if Path("/proc/cpuinfo").exists()
        else platform.processor()
    )
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{os.cpu_count()} cores ({cpu}), {platform.system()}, Python {platform.python_version()}, load "
            f"{load:.1f}")


def bench(work: Path, rows: list[int], formats: list[str], workers: int | None) -> list[dict]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    model = base_model(work, env)
    results = []
    for n in rows:
        data = write_data(work, n)
        for fmt in formats:
            cache = work / f"cache-{fmt}-{n}"
            shutil.rmtree(cache, ignore_errors=True)
            args = [
                "sft",
                "--model_path",
                str(model),
                "--data_path",
                str(data[fmt]),
                "--cache_dir",
                str(cache),
                "--output_dir",
                str(work / "runs"),
                "--max_steps",
                "1",
                "--batch_size",
                "8",
                "--eval_batches",
                "1",
            ]
            if workers:
                args += ["--tokenize_workers", str(workers)]
            row = {"rows": n, "format": fmt, "mb": data[fmt].stat().st_size / 1e6}
            for phase in ("cold", "warm"):
                first, cpu, rss = run_kit(args, env)
                row.update({f"{phase}_s": first, f"{phase}_cpu_s": cpu, f"{phase}_rss_mb": rss})
                print(f"{n:>9,} {fmt:>7} {phase}: first step after {first:.1f} s ({cpu:.1f} CPU s), "
                      f"peak RSS {rss:,.0f} MB, load {os.getloadavg()[0]:.1f}", flush=True)
            results.append(row)
            shutil.rmtree(cache, ignore_errors=True)
    return results


def table(results: list[dict]) -> str:
    lines = [
        "| rows | format | MB | cold start s (CPU s) | cold peak RSS MB | warm start s (CPU s) | warm peak "
        "RSS MB |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(f"| {r['rows']:,} | {r['format']} | {r['mb']:,.0f} | {r['cold_s']:.1f} "
                     f"({r['cold_cpu_s']:.1f}) "
                     f"| {r['cold_rss_mb']:,.0f} | {r['warm_s']:.1f} ({r['warm_cpu_s']:.1f}) | "
                     f"{r['warm_rss_mb']:,.0f} |")
    return "\n".join(lines)


def write_results(text: str, results_md: Path) -> None:
    """Replace (or append) the SECTION of RESULTS.md: it runs up to the next "## " heading."""
    old = results_md.read_text() if results_md.exists() else "# Benchmark results\n"
    if SECTION in old:
        head, _, rest = old.partition(SECTION)
        nxt = rest.find("\n## ")
        old = head.rstrip("\n") + ("\n\n" + rest[nxt + 1 :] if nxt != -1 else "\n")
    results_md.write_text(old.rstrip("\n") + "\n\n" + text.rstrip("\n") + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="100000,1000000", help="comma-separated row counts")
    parser.add_argument("--formats", default="jsonl,parquet", help="jsonl, parquet or both")
    # bench/bench_data.sh's folder
    bench_dir = Path(os.environ.get("BENCH_DATA_DIR") or ROOT / ".cache" / "bench")
    parser.add_argument("--workdir", default=str(bench_dir / "sft"), help="data, model and caches (kept for "
                                                                          "reuse)")
    parser.add_argument("--note", default=os.environ.get("BENCH_DATA_NOTE", ""), help="a sentence for "
                                                                                      "RESULTS.md")
    parser.add_argument("--tokenize_workers", type=int, default=None, help="TOKENIZE_WORKERS (default: every "
                                                                           "core)")
    parser.add_argument("--no-write", action="store_true", help="print the table without writing RESULTS.md")
    args = parser.parse_args(argv)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    rows = [int(r) for r in args.rows.split(",")]
    formats = args.formats.split(",")
    started = datetime.datetime.now(datetime.timezone.utc)
    results = bench(work, rows, formats, args.tokenize_workers)
    text = (
        f"{SECTION}\n\n`python bench/data_sft.py` ({started:%Y-%m-%d %H:%M} UTC; {device()}): `python -m "
        f"train sft "
        "--max_steps 1` on generated alpaca rows (~900 bytes each) from a nano model (vocab 8192), "
        f"TOKENIZE_WORKERS={args.tokenize_workers or 'every core'}. Start: seconds from launch to the first "
        "optimizer step's line, and in brackets the CPU seconds the process and its tokenizing workers spent "
        "to get there. Cold: no SFT cache (records read, tokenized on the workers, cache written); "
        "warm: the cache from the cold run (the data is fingerprinted, the memmaps opened). Peak RSS: the "
        f"training process (wait4), tokenizing workers not counted. {args.note}".rstrip()
        + "\n\n"
        + table(results)
    )
    print(text)
    if not args.no_write:
        write_results(text, ROOT / "bench" / "RESULTS.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
