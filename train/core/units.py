"""Units and constants every layer shares, and the machine's one count of CPU cores (torch-free:
the tokenizing worker processes import it and stay lean). "MB" in summary.json and the log is
MiB (2**20 bytes), as nvidia-smi and torch.cuda's memory statistics count it."""

import os

MIB = 2**20
IGNORE_INDEX = -100  # the label torch's cross_entropy (and transformers' causal-LM loss) skips


def cpu_cores() -> int:
    """The CPU cores this process may run on (its affinity mask, as taskset and container CPU
    sets leave it), which can be fewer than the machine has."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
