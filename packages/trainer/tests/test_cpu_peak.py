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


def test_unknown_cpu_has_no_peak() -> None:
    assert estimate_cpu_peak(2, "") is None
