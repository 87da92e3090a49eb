"""An estimate of this CPU's peak FP32 TFLOP/s, so the training log's MFU means something.

peak = threads torch uses × clock × FP32 FLOPs per cycle per core, the last from
the vector units /proc/cpuinfo reports: two FMA units of 8 lanes (AVX2, and AVX-512
on AMD, which splits it into two 256-bit halves) give 2 × 8 × 2 = 32; Intel's
AVX-512 with two 512-bit FMA units gives 64; without FMA, 16. The clock is the one
/proc/cpuinfo reports (cpufreq's maximum where available). It is an upper bound a
real run does not reach (turbo, memory bandwidth), as a GPU's data-sheet peak is.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CpuPeak:
    threads: int
    ghz: float
    flops_per_cycle: int
    isa: str

    @property
    def tflops(self) -> float:
        return self.threads * self.ghz * 1e9 * self.flops_per_cycle / 1e12

    def describe(self) -> str:
        return (
            f"CPU peak estimate for MFU: {self.threads} threads x {self.ghz:.2f} GHz x "
            f"{self.flops_per_cycle} FP32 FLOP/cycle ({self.isa}) = {self.tflops:.3f} TFLOP/s"
        )


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def _clock_ghz(cpuinfo: str) -> float | None:
    try:
        khz = int(Path("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq").read_text())
        return khz / 1e6
    except (OSError, ValueError):
        pass
    for line in cpuinfo.splitlines():
        if line.startswith("cpu MHz"):
            try:
                return float(line.split(":", 1)[1]) / 1e3
            except ValueError:
                return None
    return None


def estimate_cpu_peak(threads: int, cpuinfo: str | None = None) -> CpuPeak | None:
    """The estimate for `threads` cores, or None where /proc/cpuinfo says too little."""
    info = _cpuinfo() if cpuinfo is None else cpuinfo
    flags: set[str] = set()
    for line in info.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    ghz = _clock_ghz(info)
    if not flags or ghz is None or threads < 1:
        return None
    intel = "GenuineIntel" in info
    if "avx512f" in flags and intel:
        per_cycle, isa = 64, "AVX-512 FMA"
    elif "fma" in flags and ("avx2" in flags or "avx512f" in flags):
        per_cycle, isa = 32, "AVX2 FMA" if "avx512f" not in flags else "AVX-512 as 2x256 FMA"
    else:
        per_cycle, isa = 16, "SSE"
    return CpuPeak(threads, ghz, per_cycle, isa)
