"""AMD GPU readings for train/observe/monitor.py, best effort: amdsmi (ROCm 6+) or the rocm-smi tool.

Split from monitor.py to keep it short; monitor.py imports this only when NVML finds no GPU.
"""

import json
import re
import shutil
import subprocess

from train.core.units import MIB
from train.observe.gpus import Gpus, try_read

# ---- AMD, best effort: amdsmi (ROCm 6+) or the rocm-smi tool. Field names differ across ROCm
# releases, so every field is optional; only the NVML path and the no-GPU path are tested. ----

def _number(value) -> float | None:
    match = re.search(r"-?\d+(\.\d+)?", str(value)) if value is not None else None
    return float(match.group()) if match else None


def _amdsmi_sample(amd, handle) -> dict:
    def power(key):
        watts = _number(amd.amdsmi_get_power_info(handle).get(key))
        return watts / 1e6 if watts and watts > 1e5 else watts  # some releases report microwatts

    def temp():
        for sensor in ("HOTSPOT", "EDGE"):  # MI300 has no edge sensor
            value = try_read(lambda s=sensor: _number(amd.amdsmi_get_temp_metric(
                handle, getattr(amd.AmdSmiTemperatureType, s), amd.AmdSmiTemperatureMetric.CURRENT)))
            if value is not None:
                return value
        return None

    def clock(kind):
        return _number(amd.amdsmi_get_clock_info(handle, getattr(amd.AmdSmiClkType, kind))["clk"])

    return {
        "gpu_util": try_read(lambda: _number(amd.amdsmi_get_gpu_activity(handle)["gfx_activity"])),
        "vram_used_mb": try_read(lambda: _number(amd.amdsmi_get_gpu_vram_usage(handle)["vram_used"])),  # MB
        "vram_total_mb": try_read(lambda: _number(amd.amdsmi_get_gpu_vram_usage(handle)["vram_total"])),
        "power_w": try_read(lambda: power("average_socket_power") or power("current_socket_power")),
        "power_limit_w": try_read(lambda: power("power_limit")),
        "sm_clock_mhz": try_read(lambda: clock("GFX")),
        "mem_clock_mhz": try_read(lambda: clock("MEM")),
        "temp_c": temp(),
    }


def _rocm_smi_query() -> dict:
    # One call reports every card; it takes a fraction of a second, which is why it runs in the thread.
    out = subprocess.run(["rocm-smi", "--showuse", "--showpower", "--showmaxpower", "--showclocks",
                          "--showtemp", "--showmeminfo", "vram", "--showproductname", "--json"],
                         capture_output=True, text=True, timeout=10, check=True).stdout
    return {k: v for k, v in json.loads(out).items() if k.startswith("card")}


def _rocm_smi_sample(card: dict) -> dict:
    def field(*words: str, scale: float = 1.0) -> float | None:
        for key, value in card.items():
            if all(w.lower() in key.lower() for w in words) and _number(value) is not None:
                return _number(value) / scale
        return None

    return {
        "gpu_util": field("GPU use (%)"),
        "vram_used_mb": field("VRAM Total Used Memory (B)", scale=MIB),
        "vram_total_mb": field("VRAM Total Memory (B)", scale=MIB),
        "power_w": field("Power (W)", "Average") or field("Power (W)", "Current"),
        "power_limit_w": field("Max Graphics Package Power"),
        "sm_clock_mhz": field("sclk clock speed"),
        "mem_clock_mhz": field("mclk clock speed"),
        "temp_c": field("Temperature", "edge") or field("Temperature", "junction"),
    }


def open_amd(indices: list[int] | None) -> Gpus | None:
    """amdsmi, else rocm-smi, else None (no AMD GPU or no ROCm tools). Indices are as ROCm lists the
    cards; HIP_VISIBLE_DEVICES remapping is not followed (best effort)."""
    try:
        import amdsmi

        amdsmi.amdsmi_init()
        handles = amdsmi.amdsmi_get_processor_handles()
        handles = [handles[i] for i in indices] if indices is not None else handles
        names = [try_read(lambda h=h: amdsmi.amdsmi_get_gpu_asic_info(h)["market_name"], str) or "AMD GPU"
                 for h in handles]
        return Gpus("amdsmi", names, lambda i: _amdsmi_sample(amdsmi, handles[i]), amdsmi.amdsmi_shut_down)
    except Exception:
        pass
    if shutil.which("rocm-smi") is None:
        return None
    try:
        info = _rocm_smi_query()
        cards = sorted(info, key=lambda c: int(c[4:]) if c[4:].isdigit() else 0)
        cards = [cards[i] for i in indices] if indices is not None else cards
        names = [str(info[c].get("Card Series") or info[c].get("Card series") or c) for c in cards]
        return Gpus("rocm-smi", names, lambda i: _rocm_smi_sample(_rocm_smi_query()[cards[i]]), lambda: None)
    except Exception:
        return None
