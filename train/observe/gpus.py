"""What every GPU metrics backend (NVML in monitor.py, AMD in monitor_amd.py) hands the sampler."""

from collections.abc import Callable
from typing import NamedTuple


def try_read(read: Callable, cast: Callable = float):
    # One unsupported field (power on some boards, clocks under MIG) must not lose the others.
    try:
        value = read()
        return None if value is None else cast(value)
    except Exception:
        return None


class Gpus(NamedTuple):
    """An opened metrics backend: device names and a reader per device (by position in names)."""

    backend: str  # "nvml", "amdsmi" or "rocm-smi"
    names: list[str]
    read: Callable[[int], dict]
    close: Callable[[], None]
