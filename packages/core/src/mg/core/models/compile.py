"""Compile a built model's transformer layers with `torch.compile` (inductor).

Per layer, as torchtitan does it: all layers run the same code, so dynamo
traces one graph and every layer reuses it (compile time does not grow with
depth), while the embedding, the output layer and the loss stay eager. What is
applied around the layers afterwards or before — tensor-parallel hooks,
pipeline chunks, activation recompute — keeps working. Inductor fuses the
elementwise work between the matmuls (norms, GELU/SwiGLU, bias adds, residual
adds, and their backward) into generated kernels; matmuls and attention stay
the same library calls, so results match eager up to rounding.
"""

from __future__ import annotations

import os
import shutil

import torch
from torch import nn


class CompileUnavailableError(RuntimeError):
    """torch.compile cannot run here (no C++ compiler for inductor's CPU kernels)."""


def check_cpu_compiler() -> None:
    """Raise CompileUnavailableError if inductor has no C++ compiler to build CPU kernels."""
    candidates = [os.environ.get("CXX", ""), "g++", "clang++", "c++"]
    if not any(c and shutil.which(c) for c in candidates):
        raise CompileUnavailableError(
            "torch.compile on CPU needs a C++ compiler (g++ or clang++, or CXX set) to build "
            "inductor's kernels; install one or run without compiling"
        )


def compile_layers(model: nn.Module, device: torch.device | None = None) -> int:
    """Compile every layer of the model's `layers` lists in place; returns how many.

    Compilation happens at the first forward (the first step is slower)."""
    if device is None or device.type == "cpu":
        check_cpu_compiler()
    count = 0
    for name, module in model.named_modules():
        if not (isinstance(module, nn.ModuleList) and name.split(".")[-1] == "layers"):
            continue
        for layer in module:
            if getattr(layer, "_compiled_call_impl", None) is None:
                layer.compile()
                count += 1
    return count
