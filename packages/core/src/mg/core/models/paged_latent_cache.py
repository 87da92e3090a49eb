"""The paged cache of a multi-latent-attention model: the compressed latent, not keys and values.

MLA's point at inference: per position and layer the cache keeps the normed kv latent
(kv_lora_rank numbers) and the rotated positional key shared by all heads
(qk_pos_emb_head_dim), instead of 2 · heads · head_dim keys and values. DeepSeek-V3 in bf16:
(512 + 64) · 61 · 2 = 70,272 bytes a token, against 2 · 128 · 192 · 61 · 2 = 5.9 MB for
the same heads cached as keys and values.

Blocks, block tables, packed steps and prefix sharing are `PagedKVCache`'s (this class
reuses its `bind`); only the pool and `attend_latent` differ. A layer hands over its
step's latent and positional key; they are written into their slots, and each sequence's
keys and values are rebuilt from its gathered latents by the layer's own up projection
(`MLASelfAttention.keys_values`) for the attention of its queries. (Absorbing the up
projection into the queries, as Megatron's flash-MLA decode path does, would save that
recomputation; it is the same attention.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mg.core.models.mla import MLASelfAttention
from mg.core.models.paged_kv_cache import GATHERED, PagedKVCache, _gather, _zeroed_pool


class PagedLatentCache(PagedKVCache):
    """MLA latents in blocks, [layers, blocks, block_size, 1, kv_lora_rank + pos_dim]."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_lora_rank: int,
        qk_pos_emb_head_dim: int,
        num_heads: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        # no call to PagedKVCache.__init__: it would allocate key and value pools
        device = torch.device(device or "cpu")
        self.kv_lora_rank = kv_lora_rank
        latent = kv_lora_rank + qk_pos_emb_head_dim
        self.keys = _zeroed_pool((num_layers, num_blocks, block_size, 1, latent), dtype, device)
        """The latents (named as PagedKVCache's key pool, which `bind` and the server read)."""
        self.fp8 = False
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_heads = num_heads
        self.window_size = None
        self.layer_windows = [None] * num_layers
        self._windows = [None]
        self.softmax_scale = None
        self.layer_sinks = [None] * num_layers
        self.device = device
        self.decode_kernel = None
        self._bound = False

    @property
    def latents(self) -> Tensor:
        return self.keys

    def bytes_per_token(self) -> int:
        """What one cached position costs over all layers, measured from the pool."""
        pool = self.keys
        return pool.numel() * pool.element_size() // (self.num_blocks * self.block_size)

    @classmethod
    def for_model(
        cls, model: nn.Module, num_blocks: int, block_size: int, fp8: bool = False
    ) -> PagedLatentCache:
        """A pool for `model`'s MLA layers (their local heads under tensor parallelism)."""
        if fp8:
            raise ValueError(
                "--kv-cache-dtype fp8 is not supported for multi-latent attention's latent "
                "cache yet; use auto"
            )
        layers = [layer.self_attention for layer in model.decoder.layers]
        if not all(isinstance(a, MLASelfAttention) for a in layers):
            raise ValueError("PagedLatentCache needs a model whose every layer is MLA")
        weight = next(model.parameters())
        return cls(
            num_layers=len(layers),
            num_blocks=num_blocks,
            block_size=block_size,
            kv_lora_rank=layers[0].kv_lora_rank,
            qk_pos_emb_head_dim=layers[0].qk_pos_emb_head_dim,
            num_heads=layers[0].num_heads,
            dtype=weight.dtype,
            device=weight.device,
        )

    def use_cpu_decode_kernel(self, isa_flags: tuple[str, ...] = ()) -> str:
        return f"{GATHERED}: the latent cache rebuilds keys and values per step"

    def attend(self, layer_index: int, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        raise TypeError("PagedLatentCache holds MLA latents: layers call attend_latent")

    def attend_latent(
        self,
        layer_index: int,
        query: Tensor,
        kv_latent: Tensor,
        k_pos_emb: Tensor,
        attention: MLASelfAttention,
    ) -> Tensor:
        """Store the step's latents [1, T, kv_lora_rank] and rotated positional keys
        [1, T, pos_dim] of one layer; return the context [1, T, heads · v_head_dim] of its
        rotated queries [1, T, heads, q_head_dim] over each sequence's cached positions."""
        if not self._bound:
            raise RuntimeError("PagedLatentCache.bind(segments) must be called before a forward")
        b, t, heads, _ = query.shape
        if b != 1 or t != self._num_tokens:
            raise ValueError(
                f"PagedLatentCache is bound to a packed row of {self._num_tokens} tokens; "
                f"the step has shape [{b}, {t}]"
            )
        pool = self.keys[layer_index]
        width = pool.shape[-1]
        step = torch.cat((kv_latent[0], k_pos_emb[0]), dim=-1).to(pool.dtype)
        pool.view(-1, width).index_copy_(0, self._slots, step)
        scale = attention.core_attention.softmax_scale
        out = query.new_empty(t, heads, attention.v_head_dim)
        rows = self._decode_rows
        if rows is not None:
            q = query[0, rows][:, :, None]  # [n, heads, 1, q_head_dim]
            key, value = self._rebuild(attention, _gather(pool, self._decode_tables), q.dtype)
            bias = self._bias(q.dtype, None)  # [n, 1, 1, keys]
            context = F.scaled_dot_product_attention(q, key, value, attn_mask=bias, scale=scale)
            out[rows] = context[:, :, 0]
        for p in self._prefills:
            length = p.context + p.length
            mask = p.masks[None]
            q = query[0, p.start : p.start + p.length].transpose(0, 1)[None]
            key, value = self._rebuild(attention, _gather(pool, p.blocks)[None], q.dtype)
            if mask is None:
                key, value = key[:, :, :length], value[:, :, :length]
            context = F.scaled_dot_product_attention(
                q, key, value, attn_mask=mask, is_causal=mask is None, scale=scale
            )
            out[p.start : p.start + p.length] = context[0].transpose(0, 1)
        return out.view(1, t, -1)

    def _rebuild(
        self, attention: MLASelfAttention, latents: Tensor, dtype: torch.dtype
    ) -> tuple[Tensor, Tensor]:
        """Gathered latents [n, blocks, block_size, 1, D] → keys [n, heads, L, q_head_dim]
        and values [n, heads, L, v_head_dim], by the layer's up projection."""
        latents = latents.reshape(latents.shape[0], -1, latents.shape[-1]).to(dtype)
        kv_latent, k_pos_emb = latents.split(
            [self.kv_lora_rank, latents.shape[-1] - self.kv_lora_rank], dim=-1
        )
        key, value = attention.keys_values(kv_latent, k_pos_emb)
        return key.transpose(1, 2), value.transpose(1, 2)
