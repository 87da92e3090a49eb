"""`--log-memory-to-tensorboard`: the memory figures of this process.

On a GPU, Megatron's four from `torch.cuda.memory_stats()`: mem-reserved-bytes,
mem-allocated-bytes, mem-max-allocated-bytes (the allocator's peak) and
mem-allocated-count. On a CPU there is no caching allocator to ask, so the
process's resident set is written instead: mem-rss-bytes (now, VmRSS) and
mem-max-rss-bytes (its peak, VmHWM; the kernel's max RSS where /proc is absent).
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path

import torch


def memory_scalars(device: torch.device) -> dict[str, float]:
    """The figures for `device`'s kind, in bytes (and allocations)."""
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)  # empty before the first allocation
        return {
            "mem-reserved-bytes": stats.get("reserved_bytes.all.current", 0),
            "mem-allocated-bytes": stats.get("allocated_bytes.all.current", 0),
            "mem-max-allocated-bytes": stats.get("allocated_bytes.all.peak", 0),
            "mem-allocated-count": stats.get("allocation.all.current", 0),
        }
    status = _proc_status()
    peak = status.get("VmHWM")
    if peak is None:  # ru_maxrss: kilobytes on Linux, bytes on macOS
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak = maxrss if sys.platform == "darwin" else maxrss * 1024
    figures = {"mem-max-rss-bytes": float(peak)}
    if "VmRSS" in status:
        figures = {"mem-rss-bytes": float(status["VmRSS"]), **figures}
    return figures


def _proc_status() -> dict[str, int]:
    """/proc/self/status's memory lines in bytes (empty where there is no /proc)."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return {}
    values = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        fields = rest.split()
        if key in ("VmRSS", "VmHWM") and len(fields) == 2 and fields[1] == "kB":
            values[key] = int(fields[0]) * 1024
    return values
