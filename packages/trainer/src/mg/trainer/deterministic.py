"""Seeding and `--deterministic-mode`.

The trainer seeds python, numpy and torch with `seed` to build the model (every
layout then starts from the single-process weights), then with Megatron's
`seed + 100 * pp_rank` (`ParallelLayout.stage_seed`) for dropout; deterministic
mode additionally turns on `torch.use_deterministic_algorithms`, which makes
CUDA kernels that have no deterministic version fail loudly instead of
silently differing, and sets the cuBLAS workspace variable those kernels need.
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch


def set_seed(seed: int) -> None:
    """Seed every generator the training touches (init, dropout, numpy, python)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def enable_deterministic_mode() -> None:
    """Deterministic kernels only; call before the model is built."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
