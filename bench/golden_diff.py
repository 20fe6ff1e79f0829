"""How golden_compare.py tells two trees' runs apart: their JSON key by key, their saved tensors one by one.

Floats compare to TOL relative. Keys whose values depend on the clock or on the machine's free memory
(VOLATILE: timings, throughput, data wait, RSS, MFU, pids) are compared for presence only, and numbers
inside strings that quote free memory are masked. The saved folders (final/, checkpoints/step-*/) are
read without running code: safetensors, state.pt through torch.load(weights_only=True), JSON; a float
tensor may differ by TOL of its largest value, an integer one (RNG states, counters) not at all.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from pathlib import Path

VOLATILE = re.compile(
    r"(_s$|time|per_sec|elapsed|pid|wait|compute_frac|rss|host_memory|gpu_monitor|ram_|written|input_bound"
    r"|mfu|tflops|peak_vram|vram_total)"
)
MEMORY_WORDS = re.compile(r"MB|RAM|swap")
TOL = 1e-6


def normalize(value, places: dict):
    if isinstance(value, str):
        for path, name in places.items():
            value = value.replace(path, name)
        return value
    if isinstance(value, dict):
        return {k: normalize(v, places) for k, v in value.items()}
    if isinstance(value, list):
        return [normalize(v, places) for v in value]
    return value


def differences(a, b, where: str, key: str = "") -> list[str]:
    if key and VOLATILE.search(key):
        return [] if (a is None) == (b is None) else [f"{where}: present in one only ({a!r} vs {b!r})"]
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{where}.{k}: only in {'base' if k in a else 'new'}" for k in sorted(set(a) ^ set(b))]
        for k in sorted(set(a) & set(b)):
            out += differences(a[k], b[k], f"{where}.{k}", k)
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{where}: {len(a)} items vs {len(b)}"]
        return [
            d
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            for d in differences(x, y, f"{where}[{i}]", key)
        ]
    if isinstance(a, float) and isinstance(b, (int, float)) and not isinstance(b, bool):
        same = (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=TOL, abs_tol=1e-12)
        return [] if same else [f"{where}: {a!r} vs {b!r}"]
    if isinstance(a, str) and isinstance(b, str) and MEMORY_WORDS.search(a):
        a, b = (re.sub(r"\d[\d,.]*", "#", s) for s in (a, b))
    return [] if a == b else [f"{where}: {a!r} vs {b!r}"]


def read_run(run: Path, places: dict) -> dict:
    record = {}
    for name in ("config.json", "summary.json"):
        path = run / name
        record[name] = normalize(json.loads(path.read_text()), places) if path.exists() else None
    metrics = run / "metrics.jsonl"
    rows = None
    if metrics.exists():
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    record["metrics.jsonl"] = normalize(rows, places)
    return record


def flat(value, prefix: str, into: dict) -> dict:
    """state.pt's nested dicts and lists as {dotted key: tensor or plain value}."""
    if isinstance(value, dict):
        for k, v in value.items():
            flat(v, f"{prefix}.{k}" if prefix else str(k), into)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            flat(v, f"{prefix}[{i}]", into)
    else:
        into[prefix] = value
    return into


def read_saved(folder: Path, places: dict) -> dict:
    """{file in folder: ("tensors", {name: value}) | ("json", value) | ("bytes", sha256) | ("link", to)}."""
    import safetensors.torch
    import torch

    found = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_symlink() or p.is_file()):
        name = str(path.relative_to(folder))
        if path.is_symlink():
            found[name] = ("link", os.readlink(path))
        elif path.suffix == ".safetensors":
            found[name] = ("tensors", safetensors.torch.load_file(str(path)))
        elif path.suffix == ".pt":
            found[name] = ("tensors", flat(torch.load(path, map_location="cpu", weights_only=True), "", {}))
        elif path.suffix == ".json":
            found[name] = ("json", normalize(json.loads(path.read_text()), places))
        else:
            found[name] = ("bytes", hashlib.sha256(path.read_bytes()).hexdigest())
    return found


def tensor_differences(a, b, where: str, counts: dict) -> list[str]:
    """Exact for integers (RNG states, counters); floats within TOL of the tensor's largest value."""
    import torch

    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return differences(a, b, where)
    counts["tensors"] += 1
    if a.shape != b.shape or a.dtype != b.dtype:
        return [f"{where}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"]
    if torch.equal(a, b):
        counts["bitwise"] += 1
        return []
    if not a.is_floating_point():
        return [f"{where}: {int((a != b).sum())} of {a.numel()} values differ"]
    a, b = a.double(), b.double()
    if not torch.equal(a.isnan(), b.isnan()):
        return [f"{where}: NaN in different places"]
    a, b = a.nan_to_num(0.0), b.nan_to_num(0.0)
    gap, scale = float((a - b).abs().max()), float(a.abs().max())
    if gap <= TOL * scale + 1e-12:
        return []
    return [f"{where}: max abs difference {gap:.3g} (largest |value| {scale:.3g})"]


def saved_folders(run: Path) -> set[str]:
    return {str(f.relative_to(run)) for f in [run / "final", *run.glob("checkpoints/step-*")] if f.is_dir()}


def saved_differences(runs: tuple[Path, Path], scenario: str, places: tuple, counts: dict) -> list[str]:
    """final/ and every checkpoint of the scenario's run, file by file and tensor by tensor."""
    folders = [saved_folders(run) for run in runs]
    out = [
        f"{scenario}/{name}: only in {'base' if name in folders[0] else 'new'}"
        for name in sorted(folders[0] ^ folders[1])
    ]
    for name in sorted(folders[0] & folders[1]):
        saved = [read_saved(run / name, place) for run, place in zip(runs, places, strict=True)]
        out += [
            f"{scenario}/{name}/{f}: only in {'base' if f in saved[0] else 'new'}"
            for f in sorted(set(saved[0]) ^ set(saved[1]))
        ]
        for file in sorted(set(saved[0]) & set(saved[1])):
            (kind, a), (other, b), where = saved[0][file], saved[1][file], f"{scenario}/{name}/{file}"
            counts["files"] += 1
            if kind != other:
                out.append(f"{where}: {kind} vs {other}")
            elif kind == "tensors":
                out += [
                    f"{where}: {k}: only in {'base' if k in a else 'new'}" for k in sorted(set(a) ^ set(b))
                ]
                for k in sorted(set(a) & set(b), key=str):
                    out += tensor_differences(a[k], b[k], f"{where}: {k}", counts)
            elif (
                kind == "json"
            ):  # meta.json's timestamp, and hashes of files whose tensors are compared above
                out += [d for d in differences(a, b, where) if not re.search(r"\.(saved_at|sha256)(:|$)", d)]
            elif a != b:
                out.append(f"{where}: {a} vs {b}")
    return out
