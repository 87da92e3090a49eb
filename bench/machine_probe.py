"""How fast this machine runs right now, read before each phase of a benchmark.

The sides of a comparison run one after the other, so a machine whose speed changes
during a run puts the change on one side. On a shared VM it does: chains of AVX2 FMAs alone
have run at 63-79 and at 110 GFLOP/s a core on one 2-core VM hours apart (another guest on
the physical core, a lower clock). A benchmark calls `probe` before each phase and after the
last; it takes two short readings with the library both sides' matmuls use, under the same
ISA cap:

- an fp32 GEMM of 384 x 384 x 384 held in cache (MKL runs it near the FMA peak, so it
  reads the cores' arithmetic speed), with the benchmark's threads;
- a sum over 512 MiB, more than a server's last-level cache (memory read bandwidth).

`verdict` says whether the phases ran on one machine speed: the readings' spread within
10%, as the benchmarks already ask of the baseline run before and after the rest.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

GEMM_SIZE = 384
READ_BYTES = 512 << 20
TOLERANCE = 0.10
NOT_A_RESULT = "; the machine's speed changed during the run: not a result"


@dataclass(frozen=True)
class Reading:
    gemm_gflops: float
    read_gbps: float

    def __str__(self) -> str:
        return f"GEMM {self.gemm_gflops:.0f} GFLOP/s, memory read {self.read_gbps:.1f} GB/s"


def _seconds(work, repeats: int, tries: int = 5) -> float:
    """The median of `tries` timings of `repeats` calls, per call: a short burst of a
    higher clock (the best try) would read a speed the phase does not keep."""
    times = []
    for _ in range(tries):
        start = time.perf_counter()
        for _ in range(repeats):
            work()
        times.append((time.perf_counter() - start) / repeats)
    return statistics.median(times)


def probe(threads: int, gemm_size: int = GEMM_SIZE, read_bytes: int = READ_BYTES) -> Reading:
    """The machine's GEMM and memory-read speed now, with `threads` threads (1-2 s)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = torch.rand(gemm_size, gemm_size)
        b = torch.rand(gemm_size, gemm_size)
        out = torch.empty(gemm_size, gemm_size)
        torch.mm(a, b, out=out)  # MKL's first call sets itself up
        seconds = _seconds(lambda: torch.mm(a, b, out=out), repeats=200)
        gemm = 2 * gemm_size**3 / seconds / 1e9
        values = torch.ones(read_bytes // 4)
        values.sum()
        read = read_bytes / _seconds(values.sum, repeats=2) / 1e9
    finally:
        torch.set_num_threads(before)
    return Reading(gemm, read)


def read_into(readings: list[Reading], threads: int, moment: str) -> None:
    """Probe, keep the reading for `verdict` and print it with `moment` ("before ...")."""
    readings.append(probe(threads))
    print(f"  machine {moment}: {readings[-1]}", flush=True)


def spread(readings: list[Reading]) -> float:
    """The larger of the two readings' spread across phases: max / min - 1."""
    if len(readings) < 2:
        return 0.0
    gemm = [r.gemm_gflops for r in readings]
    read = [r.read_gbps for r in readings]
    return max(max(gemm) / min(gemm), max(read) / min(read)) - 1


def verdict(readings: list[Reading]) -> str:
    """One results line: the readings in order and whether the run counts."""
    if not readings:
        return "- machine probe: none taken"
    gemm = " / ".join(f"{r.gemm_gflops:.0f}" for r in readings)
    read = " / ".join(f"{r.read_gbps:.1f}" for r in readings)
    apart = spread(readings)
    line = (
        f"- machine probe before each phase and after the last ({len(readings)} readings): "
        f"GEMM {gemm} GFLOP/s, memory read {read} GB/s ({apart:.0%} apart)"
    )
    if apart > TOLERANCE:
        line += NOT_A_RESULT
    return line
