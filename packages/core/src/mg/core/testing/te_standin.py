"""A stand-in `transformer_engine` package for CPU tests of the code that drives TE.

Plain PyTorch modules with Transformer Engine's constructor arguments, parameter
names and `_extra_state` (`LayerNormLinear`, `Linear`, `DotProductAttention`),
`fp8_autocast` / `fp8_model_init` contexts that record how they were entered, and
the `common.recipe` classes recording their arguments. `install(monkeypatch)` puts it
in `sys.modules` and makes CUDA look present, so mg's checks pass and its TE paths
run on the CPU; the real package is exercised by the GPU tests.
"""

from __future__ import annotations

import contextlib
import sys
import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class _Extra:
    def get_extra_state(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        pass


class LayerNormLinear(_Extra, nn.Module):
    def __init__(
        self, in_features, out_features, eps=1e-5, bias=True, normalization="LayerNorm",
        zero_centered_gamma=False, params_dtype=None, device="cuda",
    ):  # fmt: skip
        super().__init__()
        kw = dict(dtype=params_dtype, device=device)
        self.eps, self.normalization, self.zero = eps, normalization, zero_centered_gamma
        self.weight = nn.Parameter(torch.randn(out_features, in_features, **kw))
        self.bias = nn.Parameter(torch.randn(out_features, **kw)) if bias else None
        self.layer_norm_weight = nn.Parameter(torch.randn(in_features, **kw))
        self.layer_norm_bias = (
            nn.Parameter(torch.randn(in_features, **kw)) if normalization == "LayerNorm" else None
        )
        RECORDER.built.append(("LayerNormLinear", RECORDER.model_init))

    def forward(self, x):
        g = self.layer_norm_weight + 1 if self.zero else self.layer_norm_weight
        if self.normalization == "RMSNorm":
            x = F.rms_norm(x, x.shape[-1:], g, self.eps)
        else:
            x = F.layer_norm(x, x.shape[-1:], g, self.layer_norm_bias, self.eps)
        return F.linear(x, self.weight, self.bias)


class Linear(_Extra, nn.Module):
    def __init__(
        self, in_features, out_features, bias=True, params_dtype=None, device="cuda"
    ):  # fmt: skip
        super().__init__()
        kw = dict(dtype=params_dtype, device=device)
        self.weight = nn.Parameter(torch.randn(out_features, in_features, **kw))
        self.bias = nn.Parameter(torch.randn(out_features, **kw)) if bias else None
        RECORDER.built.append(("Linear", RECORDER.model_init))

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class DotProductAttention(_Extra, nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.kwargs = kwargs

    def forward(self, q, k, v, attention_mask=None):
        assert q.is_contiguous() and attention_mask is None
        h, g = self.kwargs["num_attention_heads"], self.kwargs["num_gqa_groups"]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=self.kwargs["attn_mask_type"] == "causal",
            scale=self.kwargs["softmax_scale"], enable_gqa=g != h,
        )  # fmt: skip
        return out.transpose(1, 2).flatten(2)


class Recipe:
    def __init__(self, **kwargs):
        self.kind, self.kwargs = type(self).__name__, kwargs


class Recorder:
    """What the code under test did with the stand-in: (module, built under
    fp8_model_init) per TE linear built, (enabled, recipe) per fp8_autocast entered."""

    built: list = []
    autocasts: list = []
    model_init = False


RECORDER = Recorder()


@contextlib.contextmanager
def _fp8_autocast(enabled=True, fp8_recipe=None, fp8_group=None):
    RECORDER.autocasts.append((enabled, fp8_recipe))
    yield


@contextlib.contextmanager
def _fp8_model_init(enabled=True, recipe=None):
    RECORDER.model_init = enabled
    try:
        yield
    finally:
        RECORDER.model_init = False


def install(monkeypatch: Any) -> Recorder:
    """`transformer_engine` (and .pytorch, .common.recipe) as the stand-in, CUDA 'present';
    returns the recorder (modules built, autocasts entered)."""
    RECORDER.built, RECORDER.autocasts = [], []
    recipe = types.ModuleType("transformer_engine.common.recipe")
    recipe.Format = types.SimpleNamespace(E4M3="E4M3", HYBRID="HYBRID")
    for name in ("DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling"):
        setattr(recipe, name, type(name, (Recipe,), {}))
    recipe.MXFP8BlockScaling = type("MXFP8BlockScaling", (Recipe,), {})
    pytorch = types.ModuleType("transformer_engine.pytorch")
    pytorch.LayerNormLinear, pytorch.Linear = LayerNormLinear, Linear
    pytorch.DotProductAttention = DotProductAttention
    pytorch.fp8_autocast, pytorch.fp8_model_init = _fp8_autocast, _fp8_model_init
    common = types.ModuleType("transformer_engine.common")
    common.recipe = recipe
    root = types.ModuleType("transformer_engine")
    root.pytorch, root.common = pytorch, common
    for name, module in (
        ("transformer_engine", root),
        ("transformer_engine.pytorch", pytorch),
        ("transformer_engine.common", common),
        ("transformer_engine.common.recipe", recipe),
    ):
        monkeypatch.setitem(sys.modules, name, module)
    from mg.core.models import attention_backend

    # CUDA 'present' for mg's checks only: torch itself still sees none
    monkeypatch.setattr(attention_backend, "cuda_available", lambda: True)
    for name in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
        # recorded first, so what mg's code sets is undone with the rest
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    return RECORDER
