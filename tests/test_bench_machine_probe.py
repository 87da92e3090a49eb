"""bench/machine_probe.py: the readings a benchmark takes before each phase, and the line
that says whether a run's phases ran at one machine speed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "bench" / "machine_probe.py"
_SPEC = importlib.util.spec_from_file_location("_bench_machine_probe", _PATH)
machine_probe = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = machine_probe  # a dataclass looks its module up
_SPEC.loader.exec_module(machine_probe)
Reading = machine_probe.Reading


def test_a_probe_reads_positive_speeds_and_restores_the_threads() -> None:
    import torch

    before = torch.get_num_threads()
    reading = machine_probe.probe(1, gemm_size=64, read_bytes=1 << 20)
    assert reading.gemm_gflops > 0 and reading.read_gbps > 0
    assert torch.get_num_threads() == before
    assert str(reading).startswith("GEMM ") and "GB/s" in str(reading)


def test_the_verdict_marks_a_run_whose_machine_changed_speed() -> None:
    steady = [Reading(120.0, 20.0), Reading(126.0, 19.0)]
    line = machine_probe.verdict(steady)
    assert "GEMM 120 / 126 GFLOP/s" in line and "memory read 20.0 / 19.0 GB/s" in line
    assert "(5% apart)" in line and "not a result" not in line

    slowed = [*steady, Reading(95.0, 20.0)]  # the cores a fifth slower
    assert machine_probe.spread(slowed) == 126.0 / 95.0 - 1
    assert machine_probe.verdict(slowed).endswith("not a result")

    memory = [Reading(120.0, 20.0), Reading(120.0, 14.0)]
    assert machine_probe.verdict(memory).endswith("not a result")
    assert machine_probe.verdict([]) == "- machine probe: none taken"
    assert "(0% apart)" in machine_probe.verdict(steady[:1])
