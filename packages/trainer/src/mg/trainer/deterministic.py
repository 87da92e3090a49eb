"""Seeding and `--deterministic-mode`.

The trainer seeds python, numpy and torch with `seed` to build the model (every
layout then starts from the single-process weights), then with Megatron's
`seed + 100 * pp_rank` (`ParallelLayout.stage_seed`) for dropout.

Deterministic mode is Megatron's (megatron/training/determinism.py): the
environment variables the libraries read once are checked and defaulted, then
`torch.use_deterministic_algorithms` makes CUDA kernels without a deterministic
version fail loudly instead of silently differing.

    NCCL_ALGO                          Ring (set), or a list of Ring, CollnetDirect,
                                       CollnetChain, ^NVLS; Tree is refused (its
                                       reduction order is not fixed)
    NVTE_ALLOW_NONDETERMINISTIC_ALGO   0 (Transformer Engine's attention backward)
    CUBLAS_WORKSPACE_CONFIG            :4096:8 (set) or :16:8 (cuBLAS's two
                                       deterministic workspaces)
    MAMBA_DETERMINISTIC                unset, or 1

A value the user set that is not deterministic is refused in one line naming
the variable. NCCL reads its variables when a communicator is made (at
`init_process_group` with a device id) and cuBLAS when its handle is, so this
runs before the process group exists.
"""

from __future__ import annotations

import os
import random
from collections.abc import MutableMapping

import numpy as np
import torch

from mg.trainer.arguments.errors import fail

ENV_DEFAULTS: dict[str, str] = {
    "NCCL_ALGO": "Ring",
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
}
"""Megatron's DETERMINISM_ENV_VAR_DEFAULTS: set where the user left them unset."""

NCCL_ALGO_TOKENS = frozenset({"Ring", "CollnetDirect", "CollnetChain", "^NVLS"})
"""Megatron's ACCEPTED_NCCL_ALGO_TOKENS: each comma-separated token of NCCL_ALGO."""

ENV_VALUES: dict[str, frozenset[str]] = {
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": frozenset({"0"}),
    "CUBLAS_WORKSPACE_CONFIG": frozenset({":4096:8", ":16:8"}),
}
"""Megatron's ACCEPTED_ENV_VAR_VALUES: the only deterministic values of these."""


def set_seed(seed: int) -> None:
    """Seed every generator the training touches (init, dropout, numpy, python)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def check_determinism_env(env: MutableMapping[str, str]) -> None:
    """Refuse, naming the variable, a value set in `env` that is not deterministic."""
    algo = env.get("NCCL_ALGO")
    if algo is not None:
        tokens = [t.strip() for t in algo.split(",") if t.strip()]
        if not tokens or any(t not in NCCL_ALGO_TOKENS for t in tokens):
            fail(
                f"NCCL_ALGO={algo} in the environment is not deterministic under "
                f"--deterministic-mode; use {', '.join(sorted(NCCL_ALGO_TOKENS))} "
                "(comma-separated) or unset it (Ring is set)"
            )
    for name, accepted in ENV_VALUES.items():
        value = env.get(name)
        if value is not None and value not in accepted:
            fail(
                f"{name}={value} in the environment is not deterministic under "
                f"--deterministic-mode; set it to {' or '.join(sorted(accepted))} or unset it"
            )
    mamba = env.get("MAMBA_DETERMINISTIC")
    if mamba and not mamba.startswith("1"):
        fail(
            f"MAMBA_DETERMINISTIC={mamba} in the environment turns Mamba's determinism off "
            "under --deterministic-mode; unset it or set it to 1"
        )


def apply_determinism_env(env: MutableMapping[str, str] | None = None) -> None:
    """Check the determinism variables of `env` (default os.environ), then set the
    ones left unset to Megatron's values; a checked value the user set is kept."""
    env = os.environ if env is None else env
    check_determinism_env(env)
    for name, value in ENV_DEFAULTS.items():
        env.setdefault(name, value)


def enable_deterministic_mode() -> None:
    """Deterministic kernels only; call before the process group and the model exist."""
    apply_determinism_env()
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
