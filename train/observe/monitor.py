"""What the hardware did during a run: a GPU sampler thread, host and torch memory, `python -m train monitor`.

The guides diagnose slow training from a few numbers (GPU busy but VRAM at 19 %, VRAM full but GPU at
30 %, power far under the limit). This module records those numbers without changing the run: it reads
NVML (the library behind nvidia-smi) from a daemon thread and never raises into the training loop.
"MB" here is MiB (2**20 bytes), as nvidia-smi and torch.cuda memory stats count it.
"""

import argparse
import os
import re
import sys
import threading
import time
from collections.abc import Callable

from train.core.errors import UsageError
from train.core.units import MIB
from train.observe.gpus import Gpus, try_read

_AVERAGED = ("gpu_util", "power_w", "sm_clock_mhz", "mem_clock_mhz")


def _load_nvml():
    """The pynvml module (package nvidia-ml-py); imported late so machines without a GPU never need it.
    Tests replace this function with monkeypatch to feed a fake NVML."""
    import pynvml

    return pynvml


def _quietly(action: Callable[[], object]) -> None:
    try:
        action()
    except Exception:  # shutting down a metrics library must never fail the run
        pass


# ---- NVIDIA (NVML) ----

def _nvml_selector(device_index: int) -> int | str:
    """NVML index or UUID of torch's cuda:<device_index>. NVML ignores CUDA_VISIBLE_DEVICES, so with
    CUDA_VISIBLE_DEVICES=2,3 torch's cuda:0 is NVML's GPU 2; reading GPU 0 would report the wrong card."""
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if device_index >= len(visible):
        return device_index
    chosen = visible[device_index]
    return int(chosen) if chosen.isdigit() else chosen  # "GPU-<uuid>" / "MIG-<uuid>"


def _nvml_sample(nvml, handle) -> dict:
    memory = try_read(lambda: nvml.nvmlDeviceGetMemoryInfo(handle), cast=lambda m: m)
    return {
        "gpu_util": try_read(lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu),
        "vram_used_mb": try_read(lambda: memory.used / MIB),
        "vram_total_mb": try_read(lambda: memory.total / MIB),
        # NVML reports milliwatts
        "power_w": try_read(lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000),
        "power_limit_w": try_read(lambda: nvml.nvmlDeviceGetEnforcedPowerManagementLimit(handle) / 1000),
        "sm_clock_mhz": try_read(lambda: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM)),
        "mem_clock_mhz": try_read(lambda: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_MEM)),
        "temp_c": try_read(lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)),
    }


def _open_nvml(nvml, selectors: list[int | str] | None) -> Gpus:
    """Init NVML and open the given devices (None: all). Raises when there is no driver."""
    nvml.nvmlInit()
    try:
        if selectors is None:
            selectors = list(range(nvml.nvmlDeviceGetCount()))
        handles = [nvml.nvmlDeviceGetHandleByIndex(s) if isinstance(s, int)
                   else nvml.nvmlDeviceGetHandleByUUID(s) for s in selectors]
        names = [nvml.nvmlDeviceGetName(h) for h in handles]
        names = [n.decode() if isinstance(n, bytes) else str(n) for n in names]  # bytes in old pynvml
    except Exception:
        nvml.nvmlShutdown()
        raise
    return Gpus("nvml", names, lambda i: _nvml_sample(nvml, handles[i]), nvml.nvmlShutdown)


# ---- AMD, best effort (amdsmi or rocm-smi): in train/observe/monitor_amd.py ----

def _open_amd(indices: list[int] | None) -> Gpus | None:
    from train.observe.monitor_amd import open_amd

    return open_amd(indices)


# ---- the sampler thread ----

def _open_gpus(nvml, nvml_selectors: list[int | str] | None,
               amd_indices: list[int] | None) -> tuple[Gpus | None, str]:
    """NVML first, then AMD; returns (gpus, reason), the reason saying why there are none."""
    reason = "no NVIDIA or AMD GPU"
    try:
        nvml = nvml if nvml is not None else _load_nvml()
    except ImportError:
        nvml, reason = None, "nvidia-ml-py (pynvml) not installed"
    if nvml is not None:
        try:
            return _open_nvml(nvml, nvml_selectors), ""
        except Exception as err:
            reason = f"no NVIDIA driver / NVML ({err})" if str(err) else "no NVIDIA driver / NVML"
    return _open_amd(amd_indices), reason


class GpuMonitor:
    """Samples one GPU every interval_s seconds on a daemon thread; stop() returns the summary.

    Cheap by design: NVML calls take microseconds and release the GIL, and the thread sleeps on an
    Event between samples, so stop() returns at once instead of waiting out the interval.
    """

    def __init__(self, device_index: int | None, interval_s: float = 0.5, nvml=None):
        self.device_index = device_index
        self.interval_s = interval_s
        self._nvml = nvml
        self._gpus: Gpus | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._summary: dict | None = None
        self.available = False
        self.note: str | None = None  # why nothing is recorded; the caller prints it once
        self.latest: dict | None = None  # last sample, for a log line (read-only for callers)
        self._samples = 0
        self._sums = dict.fromkeys(_AVERAGED, 0.0)
        self._counts = dict.fromkeys(_AVERAGED, 0)
        self._max = {"vram_used_mb": None, "temp_c": None}
        self._last = {"vram_total_mb": None, "power_limit_w": None}

    def start(self) -> "GpuMonitor":
        if self._thread is not None or self._summary is not None:
            return self
        if self.device_index is None:
            self.note = "no GPU device (CPU run): GPU metrics not recorded"
            return self
        try:
            gpus, reason = _open_gpus(self._nvml, [_nvml_selector(self.device_index)], [self.device_index])
        except Exception as err:  # a broken driver must not stop training
            gpus, reason = None, f"GPU monitor failed: {err}"
        if gpus is None:
            self.note = f"{reason}: GPU metrics not recorded"
            return self
        self._gpus, self.available = gpus, True
        self._thread = threading.Thread(target=self._run, name="gpu-monitor", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample_once()
            self._stop.wait(self.interval_s)

    def _sample_once(self) -> None:
        try:
            sample = self._gpus.read(0)
        except Exception:
            return  # a failed read is a missing sample, never an exception in the run
        self.latest = sample
        self._samples += 1
        for key, value in sample.items():
            if value is None:
                continue
            if key in self._sums:
                self._sums[key] += value
                self._counts[key] += 1
            elif key in self._max:
                self._max[key] = value if self._max[key] is None else max(self._max[key], value)
            else:  # totals and limits: the latest reading
                self._last[key] = value

    def stop(self) -> dict:
        """Stop the thread (within about a second) and return the summary; safe to call twice."""
        if self._summary is not None:
            return self._summary
        self._stop.set()
        alive = False
        if self._thread is not None:
            self._thread.join(timeout=1.0)
            alive = self._thread.is_alive()
        if self._gpus is not None and not alive:
            if self._samples == 0:
                self._sample_once()  # a run shorter than one interval still gets a reading
            _quietly(self._gpus.close)
        self._summary = self.summary()
        return self._summary

    def summary(self) -> dict:
        def avg(key):
            return _round(self._sums[key] / self._counts[key]) if self._counts[key] else None

        return {
            "available": self.available,
            "note": self.note,
            "backend": self._gpus.backend if self._gpus else None,
            "gpu_name": self._gpus.names[0] if self._gpus else None,
            "samples": self._samples,
            "avg_gpu_util": avg("gpu_util"),
            "max_vram_used_mb": _round(self._max["vram_used_mb"]),
            "vram_total_mb": _round(self._last["vram_total_mb"]),
            "avg_power_w": avg("power_w"),
            "power_limit_w": _round(self._last["power_limit_w"]),
            "avg_sm_clock_mhz": avg("sm_clock_mhz"),
            "avg_mem_clock_mhz": avg("mem_clock_mhz"),
            "max_temp_c": _round(self._max["temp_c"]),
        }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


# ---- host and torch memory ----

def _read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:  # no /proc (macOS, Windows): the caller falls back or reports None
        return ""


def host_memory(proc_dir: str = "/proc") -> dict:
    """Process RSS and system RAM / swap in MB and %, from /proc (no psutil); None where unknown.

    Low available RAM is what makes DataLoader workers (each a copy of the process) get OOM-killed.
    """
    status = _read_text(os.path.join(proc_dir, "self", "status"))
    kb = re.search(r"^VmRSS:\s+(\d+)\s+kB", status, re.MULTILINE)
    rss = int(kb.group(1)) / 1024 if kb else None
    if rss is None:
        try:
            import resource

            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # the peak RSS, not the current
            rss = peak / MIB if sys.platform == "darwin" else peak / 1024  # bytes on macOS, kB on Linux
        except (ImportError, OSError):
            pass
    info = {}
    for line in _read_text(os.path.join(proc_dir, "meminfo")).splitlines():
        key, _, rest = line.partition(":")
        if rest.split() and rest.split()[0].isdigit():
            info[key] = int(rest.split()[0]) / 1024  # kB -> MB
    total = info.get("MemTotal") or try_read(lambda: os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    total = total / MIB if total and "MemTotal" not in info else total
    available = info.get("MemAvailable")
    if available is None and "MemFree" in info:  # kernels before 3.14 lack MemAvailable
        available = info["MemFree"] + info.get("Buffers", 0) + info.get("Cached", 0)
    swap_total, swap_free = info.get("SwapTotal"), info.get("SwapFree", 0)
    used_pct = _round(100 * (total - available) / total) if total and available is not None else None
    return {
        "rss_mb": _round(rss),
        "ram_total_mb": _round(total),
        "ram_available_mb": _round(available),
        "ram_used_pct": used_pct,
        "swap_total_mb": _round(swap_total),
        # no swap configured counts as 0 % used: nothing can be swapped out
        "swap_used_pct": (_round(100 * (swap_total - swap_free) / swap_total) if swap_total
                          else None if swap_total is None else 0.0),
    }


HOST_RAM_WARN_PCT = 90.0  # the guides' warning sign: host RAM at 94 % before workers got OOM-killed


class HostMemoryPeaks:
    """host_memory() read at a run's log points (a /proc read, well under a millisecond), keeping
    the peaks, so summary.json shows the worst moment and not only the end."""

    def __init__(self, warn_pct: float = HOST_RAM_WARN_PCT, proc_dir: str = "/proc"):
        self.warn_pct, self.proc_dir = warn_pct, proc_dir
        self.peaks = {"peak_rss_mb": None, "peak_ram_used_pct": None, "peak_swap_used_pct": None}
        self.warned = False

    def sample(self) -> str | None:
        """Read once; returns a warning line the first time system RAM use reaches warn_pct."""
        now = host_memory(self.proc_dir)
        for key, field in (("peak_rss_mb", "rss_mb"), ("peak_ram_used_pct", "ram_used_pct"),
                           ("peak_swap_used_pct", "swap_used_pct")):
            if now[field] is not None:
                old = self.peaks[key]
                self.peaks[key] = now[field] if old is None else max(old, now[field])
        pct = now["ram_used_pct"]
        if pct is not None and pct >= self.warn_pct and not self.warned:
            self.warned = True
            return (f"warning: host RAM {pct:.0f} % used (swap {_cell(now['swap_used_pct'], '{:.0f}')} %): "
                    "DataLoader workers are copies of this process and get OOM-killed first; "
                    "lower NUM_WORKERS or BATCH_SIZE")
        return None

    def summary(self) -> dict:
        self.sample()
        return {**host_memory(self.proc_dir), **self.peaks}


def torch_memory(device) -> dict:
    """Peak memory torch allocated (tensors) and reserved (its caching allocator) on a cuda device, MB.

    Reserved minus allocated is cache and fragmentation: the gap between "VRAM used" in nvidia-smi and
    what the model needs. None on CPU.
    """
    kind = getattr(device, "type", None) or str(device).split(":")[0]
    if kind != "cuda":  # decided without importing torch, which costs seconds on a CPU-only machine
        return {"peak_allocated_mb": None, "peak_reserved_mb": None, "total_mb": None}
    import torch

    if not torch.cuda.is_available():
        return {"peak_allocated_mb": None, "peak_reserved_mb": None, "total_mb": None}
    return {
        "peak_allocated_mb": round(torch.cuda.max_memory_allocated(device) / MIB, 1),
        "peak_reserved_mb": round(torch.cuda.max_memory_reserved(device) / MIB, 1),
        "total_mb": round(torch.cuda.get_device_properties(device).total_memory / MIB, 1),
    }


# ---- python -m train monitor ----

_COLUMNS = "{:<26} {:>6} {:>17} {:>12} {:>9} {:>9} {:>6} {:>9}"


def _cell(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _row(label: str, s: dict, ram_pct: float | None) -> str:
    vram = "-"
    if s.get("vram_used_mb") is not None and s.get("vram_total_mb"):
        vram = f"{100 * s['vram_used_mb'] / s['vram_total_mb']:.1f} % of {s['vram_total_mb'] / 1024:.0f}G"
    power = "-"
    if s.get("power_w") is not None:  # "250/300 W": far under the limit means the GPU is waiting
        limit = "" if s.get("power_limit_w") is None else f"/{s['power_limit_w']:.0f}"
        power = f"{s['power_w']:.0f}{limit} W"
    clocks = [_cell(s.get(k), "{:.0f} MHz") for k in ("sm_clock_mhz", "mem_clock_mhz")]
    return _COLUMNS.format(label[:26], _cell(s.get("gpu_util"), "{:.0f} %"), vram, power, *clocks,
                           _cell(s.get("temp_c"), "{:.0f} C"), _cell(ram_pct, "{:.1f} %"))


def monitor_main(argv: list[str]) -> int:
    """`python -m train monitor [--once] [--interval S] [--device N]`: a live GPU table until Ctrl-C.

    --device is the physical index nvidia-smi shows (not affected by CUDA_VISIBLE_DEVICES).
    """
    parser = argparse.ArgumentParser(prog="python -m train monitor", description="Show a live table of every "
                                                                                 "GPU (utilisation, memory, "
                                                                                 "power, clocks, "
                                                                                 "temperature) until Ctrl-C.")
    parser.add_argument("--once", action="store_true", help="print one set of rows and exit")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between rows (default 1)")
    parser.add_argument("--device", type=int, default=None, help="only this GPU (index as in nvidia-smi)")
    args = parser.parse_args(argv)
    if not args.interval > 0:
        raise UsageError(f"--interval must be > 0 seconds, got {args.interval}")
    try:
        gpus, reason = _open_gpus(None, None, None)
    except Exception as err:  # a broken driver install: say so, like the no-GPU case
        gpus, reason = None, f"GPU query failed ({err})"
    if gpus is None or not gpus.names:
        host = host_memory()
        print(f"no GPU found ({reason or 'the driver reports no devices'}); "
              f"host RAM {_cell(host['ram_used_pct'], '{:.1f}')} % used, "
              f"swap {_cell(host['swap_used_pct'], '{:.1f}')} %")
        if gpus is not None:
            _quietly(gpus.close)
        return 0
    count = len(gpus.names)
    if args.device is not None and not 0 <= args.device < count:
        _quietly(gpus.close)
        raise UsageError(f"--device {args.device}: no such GPU (found {count}: 0..{count - 1})")
    shown = list(range(count)) if args.device is None else [args.device]
    try:
        print(_COLUMNS.format("Device", "GPU %", "VRAM %", "Power", "SCLK", "MCLK", "Temp", "Host RAM"))
        while True:
            ram_pct = host_memory()["ram_used_pct"]
            for i in shown:
                print(_row(f"{i} {gpus.names[i]}", gpus.read(i), ram_pct), flush=True)
            if args.once:
                return 0
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0
    finally:
        _quietly(gpus.close)
