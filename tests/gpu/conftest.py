"""GPU-only tests (`pytest tests/gpu`): each module is skipped without CUDA.

MG_GPU_TEST_DEVICE (default cuda) names the device they run on; with
MG_GPU_TEST_DEVICE=cpu the same tests run on the CPU (bf16 or fp32, never fp16),
which checks their logic on a machine without a GPU. Only what truly needs CUDA
(CUDA graphs, the flash and cuDNN kernels) is skipped there.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # gpu_device (pytest runs with importlib)


@pytest.fixture(autouse=True)
def _restore_torch_globals(monkeypatch):
    """Deterministic mode and its environment variables stay within the test."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    for name in ("NCCL_ALGO", "NVTE_ALLOW_NONDETERMINISTIC_ALGO", "CUBLAS_WORKSPACE_CONFIG"):
        monkeypatch.setenv(name, os.environ.get(name, ""))
        if not os.environ[name]:
            monkeypatch.delenv(name)
    yield
    torch.use_deterministic_algorithms(deterministic)
