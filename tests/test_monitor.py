"""The GPU sampler, host memory and `python -m train monitor`, against a fake NVML (no GPU needed)."""

import threading
import time

import pytest

from train.core.errors import UsageError
from train.observe import monitor
from train.observe.monitor import GpuMonitor, host_memory, monitor_main, torch_memory

GIB = 2**30


class FakeNvmlError(Exception):
    pass


class FakeNvml:
    """The slice of pynvml the monitor uses. Readings come from per-device lists; the last value repeats."""

    NVMLError = FakeNvmlError
    NVML_CLOCK_SM = 1
    NVML_CLOCK_MEM = 2
    NVML_TEMPERATURE_GPU = 0

    def __init__(self, names=("NVIDIA H100 80GB HBM3",), util=(80,), used_gib=(4,), temp=(65,),
                 init_error=None, broken_fields=False):
        self.names = list(names)
        self.util, self.used_gib, self.temp = list(util), list(used_gib), list(temp)
        self.init_error, self.broken_fields = init_error, broken_fields
        self.inits = self.shutdowns = 0
        self.reads = 0

    def _next(self, values):
        return values.pop(0) if len(values) > 1 else values[0]

    def _check(self):
        if self.broken_fields:
            raise FakeNvmlError("Not Supported")

    def nvmlInit(self):
        if self.init_error:
            raise FakeNvmlError(self.init_error)
        self.inits += 1

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetCount(self):
        return len(self.names)

    def nvmlDeviceGetHandleByIndex(self, index):
        if not 0 <= index < len(self.names):
            raise FakeNvmlError("Invalid Argument")
        return index

    def nvmlDeviceGetHandleByUUID(self, uuid):
        return {"GPU-bbbb": 1}[uuid]

    def nvmlDeviceGetName(self, handle):
        return self.names[handle].encode()  # old pynvml returns bytes

    def nvmlDeviceGetUtilizationRates(self, handle):
        self._check()
        self.reads += 1
        return type("Util", (), {"gpu": self._next(self.util) + handle, "memory": 10})()

    def nvmlDeviceGetMemoryInfo(self, handle):
        self._check()
        used = self._next(self.used_gib) * GIB
        return type("Mem", (), {"used": used, "total": 16 * GIB, "free": 16 * GIB - used})()

    def nvmlDeviceGetPowerUsage(self, handle):
        self._check()
        return 150_000  # milliwatts

    def nvmlDeviceGetEnforcedPowerManagementLimit(self, handle):
        self._check()
        return 300_000

    def nvmlDeviceGetClockInfo(self, handle, clock):
        self._check()
        return {self.NVML_CLOCK_SM: 1800, self.NVML_CLOCK_MEM: 9501}[clock]

    def nvmlDeviceGetTemperature(self, handle, sensor):
        self._check()
        assert sensor == self.NVML_TEMPERATURE_GPU
        return self._next(self.temp)


@pytest.fixture(autouse=True)
def no_amd(monkeypatch):
    # The AMD fallback is best effort and untested; keep it out so results don't depend on the machine.
    monkeypatch.setattr(monitor, "_open_amd", lambda indices: None)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def _wait_for(condition, timeout=60.0):  # a hang guard: the sampler's first reading takes milliseconds
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert condition()


def _real_nvml_works() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:
        return False


# ---- GpuMonitor ----

def test_summary_numbers():
    nvml = FakeNvml(util=(20, 40, 90, None), used_gib=(1, 3, 2), temp=(60, 70, 65))
    # util None after three readings: those samples are missing a field and must not count as 0 %
    mon = GpuMonitor(0, interval_s=0.001, nvml=nvml).start()
    assert mon.available and mon.note is None
    _wait_for(lambda: mon.summary()["samples"] >= 5)
    summary = mon.stop()
    assert summary["available"] is True
    assert summary["backend"] == "nvml" and summary["gpu_name"] == "NVIDIA H100 80GB HBM3"
    assert summary["avg_gpu_util"] == 50.0  # (20 + 40 + 90) / 3
    assert summary["max_vram_used_mb"] == 3 * 1024
    assert summary["vram_total_mb"] == 16 * 1024
    assert summary["avg_power_w"] == 150.0 and summary["power_limit_w"] == 300.0
    assert summary["avg_sm_clock_mhz"] == 1800.0 and summary["avg_mem_clock_mhz"] == 9501.0
    assert summary["max_temp_c"] == 70.0
    assert nvml.shutdowns == nvml.inits == 1
    assert mon.stop() is summary  # a second stop is harmless


def test_stop_is_quick_and_thread_ends():
    """stop() wakes the sampler instead of waiting out its interval: an hour here, so a stop that
    waited it out would still be waiting when the hang guard gives up (no wall-time bound asserted)."""
    mon = GpuMonitor(0, interval_s=3600, nvml=FakeNvml()).start()
    _wait_for(lambda: mon.latest is not None)
    done: list = []
    stopper = threading.Thread(target=lambda: done.append(mon.stop()), daemon=True)
    stopper.start()
    stopper.join(timeout=120)
    assert done, "stop() waited for the sampling interval"
    summary = done[0]
    assert not any(t.name == "gpu-monitor" and t.is_alive() for t in threading.enumerate())
    assert summary["samples"] >= 1 and summary["avg_gpu_util"] == 80.0


def test_failing_fields_never_raise():
    mon = GpuMonitor(0, interval_s=0.001, nvml=FakeNvml(broken_fields=True)).start()
    _wait_for(lambda: mon.summary()["samples"] >= 2)
    summary = mon.stop()
    assert summary["available"] is True
    assert summary["avg_gpu_util"] is None and summary["max_vram_used_mb"] is None
    assert summary["max_temp_c"] is None


def test_no_device_records_nothing():
    nvml = FakeNvml()
    mon = GpuMonitor(None, nvml=nvml).start()
    summary = mon.stop()
    assert summary["available"] is False and summary["samples"] == 0
    assert "GPU metrics not recorded" in summary["note"]
    assert summary["avg_gpu_util"] is None and summary["max_vram_used_mb"] is None
    assert nvml.inits == 0  # a CPU run never touches NVML


def test_nvml_init_failure_is_a_note():
    summary = GpuMonitor(0, nvml=FakeNvml(init_error="Driver Not Loaded")).start().stop()
    assert summary["available"] is False and summary["samples"] == 0
    assert summary["note"] == "no NVIDIA driver / NVML (Driver Not Loaded): GPU metrics not recorded"


def test_pynvml_missing_is_a_note(monkeypatch):
    def missing():
        raise ImportError("No module named 'pynvml'")

    monkeypatch.setattr(monitor, "_load_nvml", missing)
    summary = GpuMonitor(0).start().stop()
    assert summary["available"] is False
    assert summary["note"].startswith("nvidia-ml-py (pynvml) not installed")


def test_cuda_visible_devices_maps_to_the_nvml_gpu(monkeypatch):
    nvml = FakeNvml(names=("GPU zero", "GPU one", "GPU two"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    assert GpuMonitor(0, nvml=nvml).start().stop()["gpu_name"] == "GPU two"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-bbbb")
    assert GpuMonitor(0, nvml=nvml).start().stop()["gpu_name"] == "GPU one"


def test_real_machine_without_driver():
    if _real_nvml_works():
        summary = GpuMonitor(0, interval_s=0.05).start().stop()
        assert summary["available"] and summary["vram_total_mb"] > 0
    else:
        summary = GpuMonitor(0).start().stop()
        assert summary["available"] is False and summary["note"].endswith("GPU metrics not recorded")


# ---- host and torch memory ----

def test_host_memory_sane():
    mem = host_memory()
    assert mem["rss_mb"] > 1
    assert mem["ram_total_mb"] > mem["rss_mb"]
    assert 0 <= mem["ram_used_pct"] <= 100
    assert mem["swap_used_pct"] is None or 0 <= mem["swap_used_pct"] <= 100


def test_host_memory_parses_proc(tmp_path):
    (tmp_path / "self").mkdir()
    (tmp_path / "self" / "status").write_text("Name:\tpython\nVmRSS:\t  204800 kB\n")
    (tmp_path / "meminfo").write_text(
        "MemTotal:       16777216 kB\nMemFree:         1048576 kB\nMemAvailable:    4194304 kB\n"
        "SwapTotal:       2097152 kB\nSwapFree:        1048576 kB\nHugePages_Total:       0\n")
    mem = host_memory(str(tmp_path))
    assert mem == {"rss_mb": 200.0, "ram_total_mb": 16384.0, "ram_available_mb": 4096.0,
                   "ram_used_pct": 75.0, "swap_total_mb": 2048.0, "swap_used_pct": 50.0}


def test_host_memory_without_proc(tmp_path):
    mem = host_memory(str(tmp_path))  # nothing there, as on macOS
    assert mem["rss_mb"] > 1  # from getrusage
    assert mem["ram_available_mb"] is None and mem["ram_used_pct"] is None and mem["swap_used_pct"] is None


def test_host_memory_peaks_and_one_warning(tmp_path):
    from train.observe.monitor import HostMemoryPeaks

    (tmp_path / "self").mkdir()

    def write(rss_kb, available_kb):
        (tmp_path / "self" / "status").write_text(f"VmRSS:\t{rss_kb} kB\n")
        (tmp_path / "meminfo").write_text(f"MemTotal: 1000000 kB\nMemAvailable: {available_kb} kB\n"
                                          "SwapTotal: 0 kB\nSwapFree: 0 kB\n")

    peaks = HostMemoryPeaks(proc_dir=str(tmp_path))
    write(102400, 500000)
    assert peaks.sample() is None  # 50 % used
    write(409600, 60000)
    warning = peaks.sample()  # 94 % used: the guides' danger sign
    assert warning.startswith("warning: host RAM 94 % used") and "NUM_WORKERS" in warning
    assert peaks.sample() is None  # said once
    write(204800, 700000)
    summary = peaks.summary()
    assert summary["rss_mb"] == 200.0 and summary["ram_used_pct"] == 30.0  # now
    assert summary["peak_rss_mb"] == 400.0 and summary["peak_ram_used_pct"] == 94.0  # worst moment
    assert summary["peak_swap_used_pct"] == 0.0


def test_torch_memory_cpu_is_none():
    assert torch_memory("cpu") == {"peak_allocated_mb": None, "peak_reserved_mb": None, "total_mb": None}


@pytest.mark.skipif(not _real_nvml_works(), reason="needs an NVIDIA GPU")
def test_torch_memory_cuda():
    import torch

    x = torch.ones(1024, 1024, device="cuda")
    mem = torch_memory(x.device)
    assert mem["peak_allocated_mb"] >= 4 and mem["peak_reserved_mb"] >= mem["peak_allocated_mb"]


# ---- python -m train monitor ----

def test_cli_once_prints_the_table(monkeypatch, capsys):
    nvml = FakeNvml(names=("NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3"))
    monkeypatch.setattr(monitor, "_load_nvml", lambda: nvml)
    assert monitor_main(["--once"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    header = ["Device", "GPU", "%", "VRAM", "%", "Power", "SCLK", "MCLK", "Temp", "Host", "RAM"]
    assert lines[0].split() == header
    row = lines[1]
    assert row.startswith("0 NVIDIA H100 80GB HBM3")
    for cell in ("80 %", "25.0 % of 16G", "150/300 W", "1800 MHz", "9501 MHz", "65 C"):
        assert cell in row
    assert row.rstrip().endswith("%")  # host RAM
    assert lines[2].startswith("1 NVIDIA H100") and "81 %" in lines[2]
    assert nvml.shutdowns == 1


def test_cli_one_device_and_bad_input(monkeypatch, capsys):
    monkeypatch.setattr(monitor, "_load_nvml", lambda: FakeNvml(names=("A", "B")))
    assert monitor_main(["--once", "--device", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[1].startswith("1 B")
    with pytest.raises(UsageError, match="--device 5"):
        monitor_main(["--once", "--device", "5"])
    with pytest.raises(UsageError, match="--interval"):
        monitor_main(["--interval", "0"])


def test_cli_live_stops_quietly_on_ctrl_c(monkeypatch, capsys):
    monkeypatch.setattr(monitor, "_load_nvml", lambda: FakeNvml())
    calls = []

    def sleep(seconds):
        calls.append(seconds)
        if len(calls) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(monitor.time, "sleep", sleep)
    assert monitor_main(["--interval", "0.25"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert calls == [0.25, 0.25] and len(out) == 3  # header + two refreshes


def test_cli_without_gpu(monkeypatch, capsys):
    monkeypatch.setattr(monitor, "_load_nvml", lambda: FakeNvml(init_error="Driver Not Loaded"))
    for argv in ([], ["--once"]):
        assert monitor_main(argv) == 0
        out = capsys.readouterr().out
        assert out.startswith("no GPU found (no NVIDIA driver / NVML (Driver Not Loaded)); host RAM ")
        assert "% used, swap " in out and len(out.splitlines()) == 1


def test_cli_real_machine(capsys):
    assert monitor_main(["--once"]) == 0
    out = capsys.readouterr().out
    if _real_nvml_works():
        assert out.startswith("Device")
    else:
        assert out.startswith("no GPU found (") and len(out.splitlines()) == 1


def test_python_m_train_monitor_once(monkeypatch, capsys):
    """The command a user types, through the CLI dispatch: a fake GPU, then none."""
    from conftest import run_cli

    monkeypatch.setattr(monitor, "_load_nvml", lambda: FakeNvml(names=("NVIDIA A100-SXM4-80GB",)))
    assert run_cli("monitor", "--once") == 0
    lines = capsys.readouterr().out.splitlines()
    assert (
        lines[0].startswith("Device") and lines[1].startswith("0 NVIDIA A100-SXM4-80GB") and len(lines) == 2
    )
    monkeypatch.setattr(monitor, "_load_nvml", lambda: FakeNvml(init_error="Driver Not Loaded"))
    assert run_cli("monitor", "--once") == 0
    assert capsys.readouterr().out.startswith("no GPU found (no NVIDIA driver / NVML (Driver Not Loaded))")
    assert run_cli("monitor", "--interval", "-1") == 2
