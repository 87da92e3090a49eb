"""A slot-based key/value cache, so a decoder step costs one token, not the whole prefix.

The cache holds `num_slots` sequences of up to `max_length` positions for every
layer. Each forward is told which slots its batch rows use and at which
position each row starts (`bind`); rows may sit at different positions, which
is what lets a server batch requests that arrived at different times
(continuous batching):

    cache = KVCache.for_model(model, num_slots=8, max_length=1024)
    cache.bind(slots=torch.tensor([3]), starts=torch.tensor([0]))
    logits = model(prompt_ids, position_ids, inference_cache=cache)     # prefill
    cache.bind(slots=torch.tensor([3, 5]), starts=torch.tensor([7, 12]))
    logits = model(next_ids[:, None], positions[:, None], inference_cache=cache)

A row's new keys/values are written at `starts[row] + i` and its queries attend
to positions `<= starts[row] + i` of its own slot only. Right-padded rows are
therefore safe: a padding position is written beyond the row's real length,
never read by the real tokens, and overwritten by the next real token.

The cache sizes itself from the attention modules of the model it is given
(`num_groups`, `head_dim`), so a model whose attention was split across
tensor-parallel ranks gets a cache of its local heads.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mg.core.models.core_attention import sink_attention, sink_logits, softcapped_attention


class KVCache:
    """Keys and values of `num_slots` sequences, [layers, slots, positions, groups, head_dim]."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        max_length: int,
        num_groups: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        window_size: tuple[int, int] | None = None,
        layer_windows: list[tuple[int, int] | None] | None = None,
        softmax_scale: float | None = None,
        softcap: float | None = None,
        layer_sinks: list[Tensor | None] | None = None,
    ) -> None:
        shape = (num_layers, num_slots, max_length, num_groups, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.num_slots = num_slots
        self.max_length = max_length
        self.window_size = window_size
        # per layer, where only some layers slide (Gemma 3's local/global pattern)
        self.layer_windows = layer_windows or [window_size] * num_layers
        self.softmax_scale = softmax_scale
        self.softcap = softcap
        # per layer, the attention-sink logits [heads] (gpt-oss) or None
        self.layer_sinks = layer_sinks or [None] * num_layers
        self._slots: Tensor | None = None
        self._starts: Tensor | None = None

    @classmethod
    def for_model(cls, model: nn.Module, num_slots: int, max_length: int) -> KVCache:
        """A cache shaped for `model` (a GPTModel), in its parameters' dtype and device."""
        attention = model.decoder.layers[0].self_attention
        weight = next(model.parameters())
        config = model.config
        return cls(
            num_layers=len(model.decoder.layers),
            num_slots=num_slots,
            max_length=max_length,
            num_groups=attention.num_groups,
            head_dim=attention.head_dim,
            dtype=weight.dtype,
            device=weight.device,
            window_size=config.window_size,
            layer_windows=[config.layer_window_size(i + 1) for i in range(config.num_layers)],
            softmax_scale=config.attention_softmax_scale,
            softcap=config.attn_logit_softcapping,
            layer_sinks=[
                sink_logits(layer.self_attention.core_attention, attention.num_heads, weight.device)
                for layer in model.decoder.layers
            ],
        )

    def bind(self, slots: Tensor, starts: Tensor) -> None:
        """Set the slot and the start position of each batch row for the next forward."""
        self._slots = slots.to(self.keys.device, torch.long)
        self._starts = starts.to(self.keys.device, torch.long)

    def update(self, layer_index: int, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Store this step's key/value [b, s, groups, d] of one layer; return the rows'
        whole keys and values [b, L, groups, d] and the bool mask [b, 1, s, L] of
        the positions each query may attend (True = attend, SDPA's convention)."""
        if self._slots is None or self._starts is None:
            raise RuntimeError("KVCache.bind(slots, starts) must be called before a forward")
        slots, starts = self._slots, self._starts
        b, s = key.shape[:2]
        if slots.shape[0] != b:
            raise ValueError(f"KVCache is bound to {slots.shape[0]} rows, the batch has {b}")
        offsets = torch.arange(s, device=key.device)
        positions = starts[:, None] + offsets  # [b, s]
        length = int(positions.max()) + 1
        if length > self.max_length:
            raise ValueError(
                f"KVCache holds {self.max_length} positions; this step writes position {length - 1}"
            )
        rows = slots[:, None].expand(b, s)
        self.keys[layer_index, rows, positions] = key.to(self.keys.dtype)
        self.values[layer_index, rows, positions] = value.to(self.values.dtype)
        keys = self.keys[layer_index, slots, :length]
        values = self.values[layer_index, slots, :length]
        j = torch.arange(length, device=key.device)
        allowed = j[None, None, :] <= positions[:, :, None]  # [b, s, L]
        window = self.layer_windows[layer_index]
        if window is not None:
            allowed &= j[None, None, :] >= positions[:, :, None] - window[0]
        return keys, values, allowed[:, None]

    def attend(self, layer_index: int, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        """Store this step's key/value of one layer and return the context [b, s, heads·d]
        of its queries [b, s, heads, d] over the cached prefix: the one method a model's
        attention calls on any inference cache (`PagedKVCache` has it too)."""
        key, value, allowed = self.update(layer_index, key, value)
        sinks = self.layer_sinks[layer_index]
        return cached_attention(
            query, key, value, allowed, self.softmax_scale, self.softcap, sinks=sinks
        )


def cached_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    allowed: Tensor,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """softmax(q kᵀ·scale) v over cached keys (scale default 1/√d; logits capped at
    `softcap` as Gemma 2 caps them; with `sinks` [heads] a sink logit per head):
    query [b, s, heads, d], key/value [b, L, groups, d], allowed [b, 1, s, L] →
    [b, s, heads·d]."""
    b, s, heads, d = query.shape
    q, k, v = (t.transpose(1, 2) for t in (query, key.to(query.dtype), value.to(query.dtype)))
    if sinks is not None and softcap is None:
        scale = scale if scale is not None else 1.0 / math.sqrt(d)
        out = sink_attention(q, k, v, allowed, sinks, scale)
        return out.transpose(1, 2).reshape(b, s, heads * d)
    if softcap is not None:
        scale = scale if scale is not None else 1.0 / math.sqrt(d)
        out = softcapped_attention(q, k, v, allowed, scale, softcap)
        return out.transpose(1, 2).reshape(b, s, heads * d)
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=allowed,
        scale=scale if scale is not None else 1.0 / math.sqrt(d),
        enable_gqa=key.shape[2] != heads,
    )
    return out.transpose(1, 2).reshape(b, s, heads * d)
