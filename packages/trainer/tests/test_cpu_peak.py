"""The CPU peak estimate behind MFU on a CPU: threads x clock x FP32 FLOP/cycle."""

from __future__ import annotations

import pytest

from mg.trainer.cpu_peak import estimate_cpu_peak

INTEL = "vendor_id\t: GenuineIntel\ncpu MHz\t\t: 3000.000\nflags\t\t: fpu sse avx2 fma avx512f\n"
AMD = "vendor_id\t: AuthenticAMD\ncpu MHz\t\t: 2596.142\nflags\t\t: fpu sse avx2 fma avx512f\n"
OLD = "vendor_id\t: GenuineIntel\ncpu MHz\t\t: 2000.0\nflags\t\t: fpu sse sse2\n"


@pytest.mark.parametrize(
    ("cpuinfo", "threads", "tflops", "per_cycle"),
    [
        (INTEL, 4, 4 * 3.0 * 64 / 1e3, 64),  # two 512-bit FMA units: 2 x 16 lanes x 2
        (AMD, 2, 2 * 2.596142 * 32 / 1e3, 32),  # AVX-512 run as two 256-bit halves
        (OLD, 1, 1 * 2.0 * 16 / 1e3, 16),
    ],
)
def test_peak_by_hand(cpuinfo, threads, tflops, per_cycle) -> None:
    peak = estimate_cpu_peak(threads, cpuinfo)
    assert peak.flops_per_cycle == per_cycle
    assert peak.tflops == pytest.approx(tflops)
    assert f"= {tflops:.3f} TFLOP/s" in peak.describe()


SPR = INTEL.replace("avx512f", "avx512f avx512_bf16 amx_bf16")
COOPER = INTEL.replace("avx512f", "avx512f avx512_bf16")


@pytest.mark.parametrize(
    ("cpuinfo", "per_cycle", "precision"),
    [
        (SPR, 1024, "BF16"),  # AMX: 16 x 32 x 16 multiply-adds per 16 cycles
        (COOPER, 128, "BF16"),  # two 512-bit units of 16 bf16 pairs
        (INTEL, 64, "FP32"),  # no bf16 units: bf16 runs on the FP32 ones
    ],
)
def test_bf16_peak_by_hand(cpuinfo, per_cycle, precision) -> None:
    peak = estimate_cpu_peak(2, cpuinfo, bf16=True)
    assert (peak.flops_per_cycle, peak.precision) == (per_cycle, precision)
    assert f"x {per_cycle} {precision} FLOP/cycle" in peak.describe()
    assert estimate_cpu_peak(2, cpuinfo).flops_per_cycle == 64  # an fp32 run: FP32 units


def test_unknown_cpu_has_no_peak() -> None:
    assert estimate_cpu_peak(2, "") is None
