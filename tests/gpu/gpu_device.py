"""The device the GPU tests run on: MG_GPU_TEST_DEVICE, default cuda (see conftest)."""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = torch.device(os.environ.get("MG_GPU_TEST_DEVICE", "cuda"))
ON_CUDA = DEVICE.type == "cuda"

needs_device = pytest.mark.skipif(
    ON_CUDA and not torch.cuda.is_available(),
    reason="needs a CUDA GPU (MG_GPU_TEST_DEVICE=cpu runs the same logic on the CPU)",
)
"""Every module's mark: skipped without CUDA unless MG_GPU_TEST_DEVICE names another device."""

cuda_only = pytest.mark.skipif(
    not (ON_CUDA and torch.cuda.is_available()), reason="a CUDA-only kernel or feature"
)
"""A test or case that has no CPU version (CUDA graphs, the flash and cuDNN kernels)."""


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """‖actual − expected‖ / ‖expected‖ in fp32 on the CPU (for gradients, whose scale
    varies between tensors)."""
    a, e = actual.detach().float().cpu(), expected.detach().float().cpu()
    return float((a - e).norm() / e.norm().clamp_min(1e-12))
