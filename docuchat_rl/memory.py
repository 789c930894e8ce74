"""Peak memory of one training step: resident memory (RSS) on a CPU, allocated memory on CUDA.

Every step's metrics record carries `memory/peak_mb`, the largest of the processes' peaks since the step
began. On CUDA that is torch's `max_memory_allocated` (reset at the step's start). On a CPU it is Linux's
peak resident set size of the process (`VmHWM` in /proc/self/status), reset at the step's start by
writing 5 to /proc/self/clear_refs (Linux >= 4.0); where that file is missing (macOS, Windows) it is the
process's peak so far (`resource.getrusage`), which only grows.

Deliberately left out: per-phase peaks (a phase's peak is the step's peak when it is the largest one; the
profiling scripts read phases) and memory of other processes (a vLLM engine's own process).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

_STATUS, _CLEAR = Path("/proc/self/status"), Path("/proc/self/clear_refs")


def reset_peak(device: torch.device) -> None:
    """Start a new peak at the current use."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        _CLEAR.write_text("5")
    except OSError:
        pass  # (no such file: the lifetime peak is reported)


def peak_mb(device: torch.device) -> float:
    """The peak since the last `reset_peak` (see the module docstring), in MiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        found = re.search(r"VmHWM:\s+(\d+)\s+kB", _STATUS.read_text())
        if found:
            return int(found.group(1)) / 1024
    except OSError:
        pass
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024
