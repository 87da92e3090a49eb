"""bench/isa_cap.py: a capped benchmark re-runs itself with the caps in its environment, so
that PyTorch, MKL and oneDNN read them when they load (set later, they are ignored)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"

SCRIPT = """
import os, sys
sys.path.insert(0, {bench!r})
import isa_cap
isa_cap.apply("avx2")
import torch
print(torch.backends.cpu.get_cpu_capability(), os.environ["MKL_ENABLE_INSTRUCTIONS"],
      os.environ["MG_CPU_ISA"])
print(isa_cap.describe("avx2"))
"""


def test_a_capped_run_restarts_with_the_caps_that_torch_reads() -> None:
    code = SCRIPT.format(bench=str(BENCH))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout.splitlines()
    assert out[0] == "AVX2 AVX2 avx2"
    assert "capped as a CPU with avx2 only" in out[1] and "ONEDNN_MAX_CPU_ISA=AVX2" in out[1]
