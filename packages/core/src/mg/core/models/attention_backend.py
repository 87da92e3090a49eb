"""Megatron's `--attention-backend` names, mapped onto the kernels this machine has.

Megatron-Core (`AttnBackend`) picks Transformer Engine's attention kernels by
name: `flash` (FlashAttention), `fused` (cuDNN fused attention), `unfused` (plain
PyTorch softmax(qkᵀ)v), `local` (Megatron's own unfused DotProductAttention) and
`auto` (TE decides). With the local layer spec the same names select PyTorch's
`scaled_dot_product_attention` kernels here:

    flash    flash-attn's `flash_attn_func` when the package imports (as
             Megatron's `--use-flash-attn`), else SDPA's FLASH_ATTENTION kernel
             (PyTorch's own build of FlashAttention-2), said once in the log
    fused    SDPA's cuDNN and memory-efficient kernels (the fused, non-flash ones)
    unfused  SDPA's MATH kernel: the reference numerics, any device and dtype
    local    the same as unfused (Megatron's local attention is unfused math)
    auto     SDPA chooses (flash or memory-efficient on a GPU, math on a CPU)

`flash` and `fused` are CUDA kernels. On a machine without CUDA they are refused
with a message naming `--attention-backend`: Megatron has no CPU path to fall
back to, and running the math kernel silently under a flag that names a fused
kernel would make timings and memory figures lie. With Transformer Engine's
DotProductAttention (`mg.core.models.te_spec.apply_transformer_engine`) the name
goes to TE through its NVTE_* variables, exactly as Megatron sets them.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
from collections.abc import Sequence

import torch
from torch.nn.attention import SDPBackend

ATTENTION_BACKEND_FLAG = "--attention-backend"

# SDPA kernels each name allows (None: no restriction, SDPA chooses).
_SDPA_KERNELS: dict[str, tuple[SDPBackend, ...] | None] = {
    "auto": None,
    "flash": (SDPBackend.FLASH_ATTENTION,),
    "fused": (SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION),
    "unfused": (SDPBackend.MATH,),
    "local": (SDPBackend.MATH,),
}
CUDA_ONLY = ("flash", "fused")

_log = logging.getLogger(__name__)
_said: set[str] = set()

# Megatron's LanguageModule._set_attention_backend: (NVTE_FLASH_ATTN, NVTE_FUSED_ATTN,
# NVTE_UNFUSED_ATTN) per name.
_NVTE_FLAGS = {
    "local": (0, 0, 0),
    "flash": (1, 0, 0),
    "fused": (0, 1, 0),
    "unfused": (0, 0, 1),
    "auto": (1, 1, 1),
}


class BackendUnavailableError(RuntimeError):
    """The chosen attention backend needs a package or a GPU this machine lacks."""


def cuda_available() -> bool:
    """Whether CUDA kernels can run here: the one question the GPU-only paths ask (a
    test's stand-in GPU packages answer it without patching torch)."""
    return torch.cuda.is_available()


def sdpa_kernels(backend: str) -> tuple[SDPBackend, ...] | None:
    """The SDPA kernels `backend` may use (None: any)."""
    return _SDPA_KERNELS[backend]


def serving_kernels(backend: str) -> tuple[SDPBackend, ...] | None:
    """The kernels of `backend` for attention over a paged KV cache, whose steps mostly
    carry a mask (which the flash kernel does not take): flash there means flash where
    a step is plain causal and the memory-efficient kernel elsewhere."""
    if backend == "flash":
        return (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)
    return sdpa_kernels(backend)


def flash_attn_installed() -> bool:
    """Whether the flash-attn package can be imported (without importing it)."""
    try:
        return importlib.util.find_spec("flash_attn") is not None
    except ValueError:  # imported already, without a spec (a stand-in module)
        return "flash_attn" in sys.modules


def use_flash_attn_package(backend: str) -> bool:
    """Whether `backend`'s core attention is flash-attn's `flash_attn_func`: flash, on
    CUDA, with the package importable. Otherwise flash runs SDPA's FLASH_ATTENTION kernel
    (a missing or broken flash-attn build, e.g. one compiled for another torch, must not
    stop a run that PyTorch's own kernel can serve), which the log says once."""
    if backend != "flash" or not cuda_available():
        return False
    reason = "is not installed"
    if flash_attn_installed():
        try:
            importlib.import_module("flash_attn")
            return True
        except ImportError as err:  # installed but built for another torch/CUDA
            reason = f"does not import ({str(err).splitlines()[0] if str(err) else err!r})"
    say_once(
        f"{ATTENTION_BACKEND_FLAG} flash: the flash-attn package {reason}; using PyTorch's "
        "scaled_dot_product_attention FLASH_ATTENTION kernel"
    )
    return False


def say_once(message: str) -> None:
    """Log `message` (a kernel choice) the first time only, not once per layer or call."""
    if message in _said:
        return
    _said.add(message)
    _log.warning(message)


def check_attention_backend(backend: str, device: torch.device | str | None = None) -> None:
    """Refuse a CUDA-only backend where its tensors would not be on a CUDA device
    (`device` None: ask whether this machine has CUDA at all)."""
    if backend not in CUDA_ONLY:
        return
    on_cuda = cuda_available() if device is None else torch.device(device).type == "cuda"
    if not on_cuda:
        raise BackendUnavailableError(
            f"{ATTENTION_BACKEND_FLAG} {backend} selects a CUDA kernel and this run has no "
            "CUDA device; use --attention-backend auto (or unfused) here"
        )


def nvte_environment(backend: str) -> dict[str, str]:
    """The NVTE_* variables Megatron sets for `backend` (Transformer Engine reads them)."""
    names = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")
    return {name: str(value) for name, value in zip(names, _NVTE_FLAGS[backend], strict=True)}


def set_nvte_environment(backend: str) -> None:
    """Set TE's kernel switches for `backend`, refusing values a user set differently
    (Megatron asserts the same, since TE reads them once)."""
    for name, value in nvte_environment(backend).items():
        current = os.environ.get(name)
        if current is not None and current != value:
            raise BackendUnavailableError(
                f"{name}={current} in the environment contradicts {ATTENTION_BACKEND_FLAG} "
                f"{backend} (which needs {value}); unset {name}"
            )
        os.environ[name] = value


def choices() -> Sequence[str]:
    """The names `--attention-backend` takes, in Megatron's order."""
    return ("flash", "fused", "unfused", "local", "auto")
