"""Multi-latent attention (DeepSeek-V2/V3): Megatron-Core's `MLASelfAttention`, local and TE specs.

Keys and values are rebuilt per head from one small latent per token, which is what an
inference cache stores (kv_lora_rank + qk_pos_emb_head_dim numbers per token and layer,
instead of 2 · heads · head_dim). RoPE is decoupled: it rotates only a separate
qk_pos_emb_head_dim part of each query and a key part shared by all heads.

    q_compressed = q_layernorm(linear_q_down_proj(x))         (q_lora_rank; or no latent:
    q            = linear_q_up_proj(q_compressed)              q = linear_q_proj(x))
                 → per head [q_no_pe (qk_head_dim) | q_pos_emb (qk_pos_emb_head_dim)]
    kv_latent, k_pos_emb = linear_kv_down_proj(x)              (kv_lora_rank | qk_pos_emb_head_dim)
    kv           = linear_kv_up_proj(kv_layernorm(kv_latent))
                 → per head [k_no_pe (qk_head_dim) | value (v_head_dim)]
    query = [q_no_pe | rope(q_pos_emb)],  key = [k_no_pe | rope(k_pos_emb), same for all heads]
    out   = linear_proj(softmax(query keyᵀ · scale) value)

The norms on the latents are there with `qk_layernorm` (Megatron's local spec: IdentityOp
otherwise). Megatron's Transformer Engine spec (`transformer_impl="transformer_engine"`)
fuses them into the up projections after them: `linear_q_up_proj` / `linear_kv_up_proj`
are then `LayerNormLinear`s holding the norms as `layer_norm_weight` (TE's
`LayerNormColumnParallelLinear`), and `q_layernorm` / `kv_layernorm` are absent; the
layer's input norm stays a module of its own there (`input_layernorm`, TE's `TENorm`).
The scale is 1/√(qk_head_dim + qk_pos_emb_head_dim), times YaRN's
mscale(s, mscale_all_dim)² with `rope_type="yarn"` (`mg.core.models.yarn`). Megatron
applies RoPE to MLA's positional parts in its interleaved form (`mla_rotary_interleaved`:
channels (0, 2, 4, …) paired with (1, 3, 5, …), gathered to the front first), as HF's
DeepSeek-V3 does with `rope_interleave`; so do we, so the weights need no permutation.

Plain PyTorch: the head counts are the whole model's until tensor parallelism sets the
local ones (`mg.core.parallel.tensor_parallel_mla`); `k_pos_emb_to_heads` is where the
shared positional key enters the per-head computation, an identity here, and tensor
parallelism's reduction point there.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from mg.core.models.config import TransformerConfig
from mg.core.models.core_attention import build_core_attention
from mg.core.models.kv_cache import KVCache
from mg.core.models.recompute_state import DiscardedOutput
from mg.core.models.rope import apply_rotary_pos_emb
from mg.core.models.te_spec import init_linear, input_linear, uses_te_spec


def deinterleave(x: Tensor) -> Tensor:
    """(x0, x1, x2, x3, …) → (x0, x2, …, x1, x3, …): Megatron's MLA RoPE pairs neighbours."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class MLASelfAttention(nn.Module):
    """Latent projections → decoupled RoPE → core attention → linear_proj (see the module
    docstring); Megatron-Core's module and parameter names."""

    recompute_up_proj = False
    """Megatron's `mla_up_proj` recompute (`mg.core.models.recompute`)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        build_norm: Callable[[TransformerConfig, int], nn.Module],
    ) -> None:
        """`build_norm(config, size)`: the decoder's norm (GPT's `build_norm`)."""
        super().__init__()
        self.layer_number = layer_number
        self.num_heads = config.num_attention_heads
        self.num_groups = config.num_attention_heads  # one key/value per head
        self.qk_head_dim = config.qk_head_dim
        self.qk_pos_emb_head_dim = config.qk_pos_emb_head_dim
        self.v_head_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.q_head_dim = config.qk_head_dim + config.qk_pos_emb_head_dim
        heads, hidden = config.num_attention_heads, config.hidden_size
        norms = config.qk_layernorm
        fused = norms and uses_te_spec(config)  # the latent norms inside the up projections
        if config.q_lora_rank is None:
            self.linear_q_proj = nn.Linear(hidden, heads * self.q_head_dim, bias=False)
        else:
            self.linear_q_down_proj = nn.Linear(hidden, config.q_lora_rank, bias=False)
            self.linear_q_up_proj = input_linear(
                config, config.q_lora_rank, heads * self.q_head_dim, False, fused
            )
        self.linear_kv_down_proj = nn.Linear(
            hidden, config.kv_lora_rank + config.qk_pos_emb_head_dim, bias=False
        )
        kv_size = heads * (config.qk_head_dim + config.v_head_dim)
        self.linear_kv_up_proj = input_linear(config, config.kv_lora_rank, kv_size, False, fused)
        separate = norms and not fused
        self.q_layernorm = (
            build_norm(config, config.q_lora_rank)
            if separate and config.q_lora_rank is not None
            else None
        )
        self.kv_layernorm = build_norm(config, config.kv_lora_rank) if separate else None
        self.k_pos_emb_to_heads = nn.Identity()
        self.core_attention = build_core_attention(config, layer_number)
        self.linear_proj = nn.Linear(heads * config.v_head_dim, hidden, bias=config.add_bias_linear)

    def init_weights(self, std: float, output_std: float) -> None:
        """N(0, σ) for the projections into the heads, N(0, σ/√(2L)) for linear_proj."""
        for name in (
            "linear_q_proj",
            "linear_q_down_proj",
            "linear_q_up_proj",
            "linear_kv_down_proj",
            "linear_kv_up_proj",
        ):
            if hasattr(self, name):
                init_linear(getattr(self, name), std)
        init_linear(self.linear_proj, output_std)
        for norm in (self.q_layernorm, self.kv_layernorm):
            if norm is not None:
                norm.reset_parameters()

    def compressed_query(self, hidden: Tensor) -> Tensor:
        """hidden [b, s, h] → what the query up projection takes: the (normed, unless
        the TE spec's linear_q_up_proj norms it) query latent, or hidden itself."""
        if hasattr(self, "linear_q_proj"):
            return hidden
        q_compressed = self.linear_q_down_proj(hidden)
        if self.q_layernorm is not None:
            q_compressed = self.q_layernorm(q_compressed)
        return q_compressed

    def query_from(self, q_compressed: Tensor) -> Tensor:
        """`compressed_query`'s output → the queries [b, s, heads, q_head_dim] before RoPE."""
        up = self.linear_q_proj if hasattr(self, "linear_q_proj") else self.linear_q_up_proj
        q = up(q_compressed)
        return q.view(*q_compressed.shape[:2], self.num_heads, self.q_head_dim)

    def query(self, hidden: Tensor) -> Tensor:
        """hidden [b, s, h] → the queries [b, s, heads, q_head_dim] before RoPE."""
        return self.query_from(self.compressed_query(hidden))

    def latent(self, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """hidden [b, s, h] → the kv latent [b, s, kv_lora_rank] (normed, unless the TE
        spec's linear_kv_up_proj norms it) and the positional key [b, s,
        qk_pos_emb_head_dim] before RoPE: what an inference cache keeps."""
        kv_combined = self.linear_kv_down_proj(hidden)
        kv_latent, k_pos_emb = kv_combined.split(
            [self.kv_lora_rank, self.qk_pos_emb_head_dim], dim=-1
        )
        if self.kv_layernorm is not None:
            kv_latent = self.kv_layernorm(kv_latent)
        return kv_latent, k_pos_emb

    def keys_values(self, kv_latent: Tensor, k_pos_emb: Tensor) -> tuple[Tensor, Tensor]:
        """The latent and the rotated positional key → per-head keys [b, L, heads,
        q_head_dim] and values [b, L, heads, v_head_dim]."""
        kv = self.linear_kv_up_proj(kv_latent)
        kv = kv.view(*kv_latent.shape[:2], self.num_heads, self.qk_head_dim + self.v_head_dim)
        k_no_pe, value = kv.split([self.qk_head_dim, self.v_head_dim], dim=-1)
        k_pos_emb = self.k_pos_emb_to_heads(k_pos_emb)[:, :, None, :]
        key = torch.cat((k_no_pe, k_pos_emb.expand(-1, -1, self.num_heads, -1)), dim=-1)
        return key, value

    def forward(
        self,
        hidden: Tensor,
        rotary: tuple[Tensor, ...] | None,
        attention_mask: Tensor | None,
        inference_cache: KVCache | None = None,
    ) -> Tensor:
        q_compressed = self.compressed_query(hidden)
        kv_latent, k_pos_emb = self.latent(hidden)
        cos, sin = rotary
        if inference_cache is not None:
            attend_latent = getattr(inference_cache, "attend_latent", None)
            if attend_latent is None:
                raise NotImplementedError(
                    f"{type(inference_cache).__name__} caches keys and values per head; "
                    "multi-latent attention needs a cache of its latent (attend_latent)"
                )
            query = self._rotated_query(self.query_from(q_compressed), cos, sin)
            k_pos_emb = self._rotated_key(k_pos_emb, cos, sin)
            context = attend_latent(self.layer_number - 1, query, kv_latent, k_pos_emb, self)
            return self.linear_proj(context)
        # --recompute-modules mla_up_proj: the up projections and RoPE run again in the
        # backward pass, their outputs freed once the attention core has saved them
        up = DiscardedOutput(self.up_projections) if self.recompute_up_proj else None
        inputs = (q_compressed, kv_latent, k_pos_emb, cos, sin)
        query, key, value = up.run(*inputs) if up is not None else self.up_projections(*inputs)
        context = self.core_attention(query, key, value, attention_mask=attention_mask)
        if up is not None:
            up.discard(context)
        return self.linear_proj(context)

    def _rotated_query(self, query: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        q_no_pe, q_pos_emb = query.split([self.qk_head_dim, self.qk_pos_emb_head_dim], dim=-1)
        q_pos_emb = apply_rotary_pos_emb(deinterleave(q_pos_emb), cos, sin)
        return torch.cat((q_no_pe, q_pos_emb), dim=-1)

    def _rotated_key(self, k_pos_emb: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return apply_rotary_pos_emb(deinterleave(k_pos_emb)[:, :, None, :], cos, sin)[:, :, 0]

    def up_projections(
        self, q_compressed: Tensor, kv_latent: Tensor, k_pos_emb: Tensor, cos: Tensor, sin: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The latents → the attention core's query, key and value: the up projections
        and RoPE (Megatron's `qkv_up_proj_and_rope_apply`), contiguous."""
        query = self._rotated_query(self.query_from(q_compressed), cos, sin)
        key, value = self.keys_values(kv_latent, self._rotated_key(k_pos_emb, cos, sin))
        return query.contiguous(), key.contiguous(), value.contiguous()
