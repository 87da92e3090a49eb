"""Core attention backends: softmax(q kᵀ / √d) v, swappable at build time.

This is Megatron-Core's layer-spec idea at the one place where it pays: the
model class stays the same and `config.attention_backend` picks the module
that computes attention from already-projected, already-rotated q, k, v.

Contract of every backend module:
    forward(query [b, s, heads, d], key [b, s, groups, d], value [b, s, groups, d],
            attention_mask: bool [b|1, 1, s, s] | None) -> [b, s, heads * d]
Attention is causal (and windowed when `config.window_size` is set) unless
the module is built with `causal=False` (BERT and the T5 encoder, T5 cross
attention, where the key length may differ from the query length). An
`attention_mask` follows Megatron's convention: True marks a position that may
NOT be attended; it is applied on top of the causal mask.

"sdpa" (default) runs everywhere; "flash" and "te" import their GPU libraries
lazily and say what to install when they are missing.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mg.core.models.config import TransformerConfig


class BackendUnavailableError(RuntimeError):
    """The chosen attention backend needs a package or a GPU this machine lacks."""


def causal_mask(seq_length: int, window_size: tuple[int, int] | None, device) -> Tensor:
    """Bool [s, s], True where query i may attend key j: j <= i, and j >= i - left
    with a sliding window (left, 0)."""
    i = torch.arange(seq_length, device=device)[:, None]
    j = torch.arange(seq_length, device=device)[None, :]
    allowed = j <= i
    if window_size is not None:
        allowed &= j >= i - window_size[0]
    return allowed


class SDPAttention(nn.Module):
    """`torch.nn.functional.scaled_dot_product_attention`: CPU and GPU, any dtype.

    The plain causal case uses `is_causal=True` so PyTorch can pick its flash or
    memory-efficient kernel; a sliding window or a user mask becomes an
    explicit boolean mask.
    """

    def __init__(
        self, config: TransformerConfig, layer_number: int = 1, causal: bool = True
    ) -> None:
        super().__init__()
        self.causal = causal
        self.num_heads = config.num_attention_heads
        self.num_groups = config.num_query_groups
        self.window_size = config.window_size if causal else None
        self.dropout = config.attention_dropout
        self.softmax_scale = 1.0 / math.sqrt(config.kv_channels)

    def forward(
        self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None = None
    ) -> Tensor:
        b, s = query.shape[:2]
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [b, heads, s, d]
        mask = None
        if not self.causal:
            mask = None if attention_mask is None else ~attention_mask
        elif self.window_size is not None or attention_mask is not None:
            mask = causal_mask(s, self.window_size, query.device)
            if attention_mask is not None:
                mask = mask & ~attention_mask
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=self.causal and mask is None,
            scale=self.softmax_scale,
            enable_gqa=self.num_groups != self.num_heads,
        )
        return out.transpose(1, 2).reshape(b, s, -1)


def _require(module: str, pip_name: str, backend: str) -> ModuleType:
    try:
        imported = importlib.import_module(module)
    except ImportError as err:
        raise BackendUnavailableError(
            f"attention_backend={backend!r} needs the {pip_name} package, which is not "
            f"installed ({err}). Install the GPU extra (`uv sync --extra gpu`, or "
            f"`pip install 'mg-core[gpu]'`), or use attention_backend='sdpa'."
        ) from err
    if not torch.cuda.is_available():
        raise BackendUnavailableError(
            f"attention_backend={backend!r} needs a CUDA GPU and none is visible; "
            "use attention_backend='sdpa' on this machine."
        )
    return imported


class FlashAttention(nn.Module):
    """flash-attn 2 (`flash_attn_func`): bshd layout and GQA natively, no masks."""

    def __init__(
        self, config: TransformerConfig, layer_number: int = 1, causal: bool = True
    ) -> None:
        super().__init__()
        self._flash_attn_func = _require("flash_attn", "flash-attn", "flash").flash_attn_func
        self.causal = causal
        self.window_size = (config.window_size if causal else None) or (-1, -1)
        self.dropout = config.attention_dropout
        self.softmax_scale = 1.0 / math.sqrt(config.kv_channels)

    def forward(
        self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None = None
    ) -> Tensor:
        if attention_mask is not None:
            raise ValueError(
                "attention_backend='flash' takes no attention_mask (causal/windowed or "
                "unmasked only); "
                "use attention_backend='sdpa' for custom masks"
            )
        out = self._flash_attn_func(
            query,
            key,
            value,
            dropout_p=self.dropout if self.training else 0.0,
            softmax_scale=self.softmax_scale,
            causal=self.causal,
            window_size=self.window_size,
        )
        return out.reshape(*query.shape[:2], -1)


def _build_te(config: TransformerConfig, layer_number: int = 1, causal: bool = True) -> nn.Module:
    """Transformer Engine's DotProductAttention, used as the module itself so its
    `_extra_state` sits at `...core_attention._extra_state`, where Megatron's TE
    spec keeps it. Its forward matches the contract above (bshd, causal)."""
    te = _require("transformer_engine.pytorch", "transformer-engine", "te")
    return te.DotProductAttention(
        num_attention_heads=config.num_attention_heads,
        kv_channels=config.kv_channels,
        num_gqa_groups=config.num_query_groups,
        attention_dropout=config.attention_dropout,
        qkv_format="bshd",
        attn_mask_type="causal" if causal else "no_mask",
        window_size=config.window_size if causal else None,
        layer_number=layer_number,
    )


CORE_ATTENTION_BACKENDS: dict[str, Callable[..., nn.Module]] = {
    "sdpa": SDPAttention,
    "flash": FlashAttention,
    "te": _build_te,
}


def build_core_attention(
    config: TransformerConfig, layer_number: int = 1, causal: bool = True
) -> nn.Module:
    """The core-attention module for `config.attention_backend` (layer_number is 1-based)."""
    try:
        builder = CORE_ATTENTION_BACKENDS[config.attention_backend]
    except KeyError:
        raise ValueError(
            f"unknown attention_backend {config.attention_backend!r}; "
            f"known: {sorted(CORE_ATTENTION_BACKENDS)}"
        ) from None
    if causal:  # keep the two-argument call for backends registered by others
        return builder(config, layer_number)
    return builder(config, layer_number, causal=False)
