"""An estimate of this CPU's peak TFLOP/s, so the training log's MFU means something.

peak = threads torch uses × clock × FP32 FLOPs per cycle per core, the last from
the vector units /proc/cpuinfo reports: two FMA units of 8 lanes (AVX2, and AVX-512
on AMD, which splits it into two 256-bit halves) give 2 × 8 × 2 = 32; Intel's
AVX-512 with two 512-bit FMA units gives 64; without FMA, 16. The clock is the one
/proc/cpuinfo reports (cpufreq's maximum where available). It is an upper bound a
real run does not reach (turbo, memory bandwidth), as a GPU's data-sheet peak is.

A bf16 run is measured against the bf16 units where the CPU has them, as a GPU's
MFU is against its bf16 peak: AMX tiles (`amx_bf16`) do 1,024 bf16 FLOPs per cycle
per core (16 x 32 x 16 multiply-adds in 16 cycles), AVX-512 BF16 dot products
(`avx512_bf16`) 2 units x 16 pairs x 2 x 2 = 128. Without either, bf16 matmuls
run through the FP32 units and the FP32 peak stands.
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
    precision: str = "FP32"

    @property
    def tflops(self) -> float:
        return self.threads * self.ghz * 1e9 * self.flops_per_cycle / 1e12

    def describe(self) -> str:
        return (
            f"CPU peak estimate for MFU: {self.threads} threads x {self.ghz:.2f} GHz x "
            f"{self.flops_per_cycle} {self.precision} FLOP/cycle ({self.isa}) = "
            f"{self.tflops:.3f} TFLOP/s"
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


def estimate_cpu_peak(
    threads: int, cpuinfo: str | None = None, *, bf16: bool = False
) -> CpuPeak | None:
    """The estimate for `threads` cores (of bf16 math with `bf16`), or None where
    /proc/cpuinfo says too little."""
    info = _cpuinfo() if cpuinfo is None else cpuinfo
    flags: set[str] = set()
    for line in info.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    ghz = _clock_ghz(info)
    if not flags or ghz is None or threads < 1:
        return None
    if bf16 and "amx_bf16" in flags:
        return CpuPeak(threads, ghz, 1024, "AMX tiles", "BF16")
    if bf16 and "avx512_bf16" in flags:
        return CpuPeak(threads, ghz, 128, "AVX-512 BF16", "BF16")
    intel = "GenuineIntel" in info
    if "avx512f" in flags and intel:
        per_cycle, isa = 64, "AVX-512 FMA"
    elif "fma" in flags and ("avx2" in flags or "avx512f" in flags):
        per_cycle, isa = 32, "AVX2 FMA" if "avx512f" not in flags else "AVX-512 as 2x256 FMA"
    else:
        per_cycle, isa = 16, "SSE"
    return CpuPeak(threads, ghz, per_cycle, isa)
