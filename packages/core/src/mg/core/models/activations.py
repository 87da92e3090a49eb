"""The MLP activations, named by `TransformerConfig.activation`, for the dense MLP and the
MoE experts alike.

A gated activation ("swiglu", "geglu", "geglu_tanh", "quick_geglu") splits linear_fc1's
output into [gate; up] (Megatron's order, `torch.chunk(x, 2)`) and computes, as
Megatron-Core's `MLP.glu` does in its unfused path:

    gate = min(gate, L);  up = clamp(up, -L, L)      with activation_func_clamp_value L
    out  = act(gate) · (up + c)                       with glu_linear_offset c

gpt-oss's experts are quick_geglu with L = 7, c = 1: act(g) = g · sigmoid(1.702 g)
(transformers' GptOssExperts: `glu = gate * sigmoid(gate * alpha)`, `(up + 1) * glu`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from mg.core.models.config import TransformerConfig

QUICK_GELU_ALPHA = 1.702
"""Megatron's `quick_gelu` gain (gpt-oss's `swiglu_alpha`)."""


def quick_gelu(x: Tensor) -> Tensor:
    """x · sigmoid(1.702 x): Megatron-Core's `quick_gelu`."""
    return x * torch.sigmoid(QUICK_GELU_ALPHA * x)


def squared_relu(x: Tensor) -> Tensor:
    return F.relu(x).square()


ACTIVATION_FUNCTIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu": F.gelu,  # exact (erf) GELU: Megatron's default activation_func
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),  # GPT-2's "gelu_new"
    "relu": F.relu,
    "squared_relu": squared_relu,
    "swiglu": F.silu,  # applied to the gate half
    "geglu": F.gelu,
    "geglu_tanh": lambda x: F.gelu(x, approximate="tanh"),  # Gemma's gelu_pytorch_tanh
    "quick_geglu": quick_gelu,  # gpt-oss
}


def gated(
    hidden: Tensor,
    act: Callable[[Tensor], Tensor],
    clamp: float | None = None,
    offset: float = 0.0,
) -> Tensor:
    """act(gate) · (up + offset) of linear_fc1's [gate; up] output, clamped first if
    `clamp` is given."""
    gate, up = hidden.chunk(2, dim=-1)
    if clamp is not None:
        gate = gate.clamp(max=clamp)
        up = up.clamp(min=-clamp, max=clamp)
    if offset:
        up = up + offset
    return act(gate) * up


def activate(hidden: Tensor, config: TransformerConfig) -> Tensor:
    """The MLP activation of `config` on linear_fc1's output (gated or not)."""
    act = ACTIVATION_FUNCTIONS[config.activation]
    if config.gated_linear_unit:
        return gated(hidden, act, config.activation_func_clamp_value, config.glu_linear_offset)
    return act(hidden)
