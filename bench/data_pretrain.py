"""Pretraining data at size: the kit's token cache build against the tokenizer's own encode_batch.

Generates its corpora offline (short documents of shuffled lines from this Python's standard
library: no download), as JSONL and as parquet of 100 MB and 1 GB (BENCH_DATA_SIZES), then for
each corpus, in this one run on this one machine:
- reference: the same tokenizer's encode_batch (all cores, its own threads) streamed over the
  same documents, read the plainest way (json.loads per line / a parquet column per batch);
- kit, cold: `python -m train pretrain` with MAX_STEPS=1 and TOKENIZER_PATH (so BPE training is
  not timed) and an empty CACHE_DIR: wall time to the end of the first step, the build's own
  tokens/s (its "cached ..." line), peak RSS of the main process and of all its processes;
- kit, warm: the same command again (the token cache is there).
Writes the table into bench/RESULTS.md (section "Pretraining data at size"), with device and date.
Usage: python bench/data_pretrain.py [--sizes 100,1000] [--work .cache/bench]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SECTION = "## Pretraining data at size (`make bench-data`)"


def source_lines() -> list[str]:
    from train.data.text import builtin_corpus_files

    lines = []
    for path in builtin_corpus_files():
        try:
            lines += [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        except (UnicodeDecodeError, OSError):
            continue
    return lines


def make_jsonl(path: Path, megabytes: int) -> None:
    """Short documents (3-40 shuffled lines) up to `megabytes`, written as they are made."""
    if path.exists() and path.stat().st_size >= megabytes * 1_000_000:
        return
    lines, rng = source_lines(), random.Random(megabytes)
    tmp = path.with_suffix(".tmp")
    written = 0
    with open(tmp, "w", encoding="utf-8") as out:
        while written < megabytes * 1_000_000:
            doc = "\n".join(rng.choice(lines) for _ in range(rng.randint(3, 40)))
            row = json.dumps({"text": doc, "source": "stdlib"}) + "\n"
            out.write(row)
            written += len(row.encode())
    os.replace(tmp, path)


def make_parquet(jsonl: Path, path: Path) -> None:
    """The same documents as parquet (row groups of 50k rows), converted in batches."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if path.exists():
        return
    tmp = path.with_suffix(".tmp")
    schema = pa.schema([("text", pa.string()), ("source", pa.string())])
    with pq.ParquetWriter(tmp, schema) as writer, open(jsonl, encoding="utf-8") as src:
        batch = []
        for line in src:
            batch.append(json.loads(line))
            if len(batch) == 50_000:
                writer.write_table(pa.Table.from_pylist(batch, schema))
                batch = []
        if batch:
            writer.write_table(pa.Table.from_pylist(batch, schema))
    os.replace(tmp, path)


def make_tokenizer(folder: Path) -> Path:
    """A byte-level BPE (vocab 8192) trained on the built-in corpus, saved as TOKENIZER_PATH."""
    if (folder / "tokenizer.json").exists():
        return folder
    from train.data import text

    files = text.builtin_corpus_files()
    tok = text.load_tokenizer(
        None, files, text.corpus_fingerprint(files), 8192, folder.parent / "cache-tok", print
    )
    tok.save_pretrained(folder)
    return folder


def texts_of(path: Path, batch_docs: int = 2000):
    """Batches of documents, read the plainest way."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(path).iter_batches(batch_size=batch_docs, columns=["text"]):
            yield batch.column(0).to_pylist()
        return
    batch = []
    with open(path, encoding="utf-8") as src:
        for line in src:
            batch.append(json.loads(line)["text"])
            if len(batch) == batch_docs:
                yield batch
                batch = []
    if batch:
        yield batch


def reference(path: Path, tokenizer: Path) -> dict:
    """encode_batch over every document (its own threads on every core); +1 end-of-text each."""
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    began, tokens = time.perf_counter(), 0
    for docs in texts_of(path):
        tokens += sum(len(e.ids) for e in backend.encode_batch(docs, add_special_tokens=False)) + len(docs)
    seconds = time.perf_counter() - began
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def tree_rss_mb(pid: int) -> tuple[float, float]:
    """(RSS of pid, RSS of pid and all its descendants) in MB, from /proc."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(entry))
            rss[int(entry)] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            continue
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += rss.get(p, 0)
        todo += children.get(p, [])
    return rss.get(pid, 0) / 2**20, total / 2**20


def kit_run(data: Path, tokenizer: Path, cache: Path, runs: Path) -> dict:
    """One `python -m train pretrain` to its first step: wall time, peak RSS, the build's rate."""
    argv = [
        sys.executable,
        "-m",
        "train",
        "pretrain",
        "--model_size",
        "nano",
        "--max_steps",
        "1",
        "--data_path",
        str(data),
        "--tokenizer_path",
        str(tokenizer),
        "--cache_dir",
        str(cache),
        "--output_dir",
        str(runs),
        "--run_name",
        "bench",
        "--overwrite",
        "1",
        "--val_fraction",
        "0",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    log_path = runs.parent / "kit-run.log"
    runs.parent.mkdir(parents=True, exist_ok=True)
    began, first_step = time.perf_counter(), None
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT, text=True)
        peak_main = peak_all = build_main = build_all = 0.0
        while proc.poll() is None:
            main, whole = tree_rss_mb(proc.pid)
            peak_main, peak_all = max(peak_main, main), max(peak_all, whole)
            text = log_path.read_text()
            if "resolved config:" not in text:  # still loading data (the config is printed after)
                build_main, build_all = peak_main, peak_all
            if first_step is None and "step 1/1" in text:
                first_step = time.perf_counter() - began
            time.sleep(0.1)
    seconds = time.perf_counter() - began
    log = log_path.read_text()
    if proc.returncode != 0:
        raise SystemExit(f"kit run failed ({proc.returncode}):\n{log[-3000:]}")
    cached = re.search(r"cached ([\d,]+) tokens .*?; [\d.]+ MB/s, ([\d,]+) tokens/s\)", log)
    return {"seconds": first_step or seconds, "whole_s": seconds, "build_main_mb": build_main,
            "build_all_mb": build_all, "peak_main_mb": peak_main, "peak_all_mb": peak_all,
            "tokens": int(cached.group(1).replace(",", "")) if cached else None,
            "tokens_per_s": int(cached.group(2).replace(",", "")) if cached else None}  # fmt: skip


def kit_build(path: Path, tokenizer: Path, cache: Path) -> dict:
    """The kit's token cache build alone, in this process (every core): tokens/s."""
    import shutil

    from transformers import AutoTokenizer

    from train.data import text

    shutil.rmtree(cache, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(tokenizer)
    files = text.corpus_files(str(path))
    began = time.perf_counter()
    tokens = text.token_cache(files, text.corpus_fingerprint(files), tok, cache, lambda line: None)
    seconds = time.perf_counter() - began
    shutil.rmtree(cache, ignore_errors=True)
    return {"tokens": len(tokens), "seconds": seconds, "tokens_per_s": len(tokens) / seconds}


def measure(corpus: Path, tokenizer: Path, work: Path, passes: int, with_reference: bool) -> dict:
    """Reference and kit builds alternated `passes` times (the best of each: on a shared
    machine the load changes from minute to minute), then a cold and a warm CLI run."""
    import shutil

    cache = work / f"cache-{corpus.name}"
    refs, kits = [], []
    for n in range(passes):
        if with_reference:
            print(f"[{corpus.name}] reference encode_batch, pass {n + 1} ...", flush=True)
            refs.append(reference(corpus, tokenizer))
        print(f"[{corpus.name}] kit build, pass {n + 1} ...", flush=True)
        kits.append(kit_build(corpus, tokenizer, cache))
    shutil.rmtree(cache, ignore_errors=True)
    print(f"[{corpus.name}] kit, cold run ...", flush=True)
    cold = kit_run(corpus, tokenizer, cache, work / "runs")
    print(f"[{corpus.name}] kit, warm run ...", flush=True)
    warm = kit_run(corpus, tokenizer, cache, work / "runs")
    shutil.rmtree(cache, ignore_errors=True)
    if not kits:  # --passes 0: the cold run's own build is the kit's figure
        kits.append({"tokens": cold["tokens"], "tokens_per_s": cold["tokens_per_s"]})
    best = lambda runs: max(runs, key=lambda r: r["tokens_per_s"]) if runs else None  # noqa: E731
    row = {"corpus": corpus.name, "mb": corpus.stat().st_size / 1e6, "ref": best(refs), "kit": best(kits),
           "cold": cold, "warm": warm, "passes": passes}  # fmt: skip
    row["ratio"] = row["kit"]["tokens_per_s"] / row["ref"]["tokens_per_s"] if refs else None
    print(json.dumps(row), flush=True)
    return row


def table(rows: list[dict]) -> str:
    head = ("| corpus | MB on disk | tokens | encode_batch tokens/s | kit tokens/s | kit / encode_batch | "
            "cold: to step 1 | warm: to step 1 | peak RSS building the cache: main (all processes) | "
            "peak RSS of the run, cold / warm |")  # fmt: skip
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        ref = r["ref"]
        same = "" if ref is None or r["kit"]["tokens"] == ref["tokens"] else " (counts differ!)"
        ref_rate = f"{ref['tokens_per_s']:,.0f}" if ref else "not run"
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] else "-"
        lines.append(
            f"| {r['corpus']} | {r['mb']:,.0f} | {r['kit']['tokens']:,}{same} | {ref_rate} | "
            f"{r['kit']['tokens_per_s']:,.0f} | {ratio} | {r['cold']['seconds']:.1f} s | "
            f"{r['warm']['seconds']:.1f} s | "
            f"{r['cold']['build_main_mb']:,.0f} MB ({r['cold']['build_all_mb']:,.0f} MB) | "
            f"{r['cold']['peak_main_mb']:,.0f} / {r['warm']['peak_main_mb']:,.0f} MB |"
        )
    return "\n".join(lines)


def device() -> str:
    try:
        model = next(
            line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")
        )
    except (OSError, StopIteration):
        model = platform.processor() or "unknown CPU"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model}, {cores} cores usable, Python {platform.python_version()}"


def write_results(rows: list[dict], note: str) -> None:
    path = ROOT / "bench" / "RESULTS.md"
    text = path.read_text()
    body = (f"{SECTION}\n\nMeasured {datetime.date.today().isoformat()} on {device()} by `make bench-data` "
            f"(bench/data_pretrain.py). {note}\n\n{table(rows)}\n")  # fmt: skip
    if SECTION in text:
        start = text.index(SECTION)
        end = text.find("\n## ", start + len(SECTION))
        text = text[:start] + body + (text[end:] if end != -1 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + body
    path.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes", default=os.environ.get("BENCH_DATA_SIZES", "100,1000"), help="corpus sizes in MB"
    )
    parser.add_argument("--work", default=str(ROOT / ".cache" / "bench"), help="where corpora and caches go")
    parser.add_argument("--formats", default="jsonl,parquet")
    parser.add_argument("--note", default="", help="a sentence for RESULTS.md (load on the machine ...)")
    parser.add_argument("--passes", type=int, default=2,
                        help="reference / kit builds alternated per corpus (0: only the cold run's build)")
    parser.add_argument("--reference-max-mb", type=int, default=100_000, help="skip the reference above this "
                                                                              "size")
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(work / "tokenizer")
    rows: list[dict] = []
    for mb in (int(s) for s in args.sizes.split(",")):
        jsonl = work / f"corpus-{mb}mb.jsonl"
        print(f"generating {jsonl} ...", flush=True)
        make_jsonl(jsonl, mb)
        corpora = {"jsonl": jsonl}
        if "parquet" in args.formats:
            corpora["parquet"] = work / f"corpus-{mb}mb.parquet"
            make_parquet(jsonl, corpora["parquet"])
        passes = args.passes if mb <= 200 else min(args.passes, 1)  # a 1 GB pass takes minutes on 2 cores
        for fmt in args.formats.split(","):
            rows = remember(work, measure(corpora[fmt], tokenizer, work, passes, mb <= args.reference_max_mb))
            write_results(rows, args.note)
    print(table(rows))


def remember(work: Path, row: dict) -> list[dict]:
    """Every corpus measured in this work folder (a later run of one corpus replaces its row),
    so sizes measured in separate runs share one table."""
    store = work / "results.json"
    rows = {r["corpus"]: r for r in (json.loads(store.read_text()) if store.exists() else [])}
    rows[row["corpus"]] = row
    # (generated size in the name)
    size = lambda r: int(re.search(r"(\d+)mb", r["corpus"]).group(1))  # noqa: E731
    ordered = sorted(rows.values(), key=lambda r: (size(r), r["corpus"]))
    store.write_text(json.dumps(ordered, indent=1))
    return ordered


if __name__ == "__main__":
    main()
