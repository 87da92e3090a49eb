"""Rotary position embeddings (RoPE), the "rotate half" form Megatron and HF Llama use.

Channel i of a head's rotated part is paired with channel i + rotary_dim/2 (not
with its neighbour, which is the "interleaved" form of the Meta checkpoints).
Megatron-Core and HF-format Llama/Mistral weights both use this form, so
converting between them needs no permutation of the query/key rows.

No buffers are kept: the tables are computed per forward from the config (a
few hundred numbers), so a model built on the meta device needs nothing
re-initialised for RoPE after `to_empty`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from mg.core.models.config import RopeScaling, TransformerConfig
from mg.core.models.yarn import yarn_concentration_factor, yarn_inv_freq


def llama3_scale_inv_freq(inv_freq: Tensor, scaling: RopeScaling) -> Tensor:
    """Llama 3.1's frequency scaling: long wavelengths are stretched by `factor`,
    short ones kept, the band between interpolated smoothly (same as HF "llama3"
    and Megatron-Core's `RotaryEmbedding._apply_scaling`)."""
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_inv_freq(
    config: TransformerConfig, device: torch.device | None = None, local: bool = False
) -> Tensor:
    """Inverse frequencies [rotary_dim / 2] in fp32; `local`: the sliding-window layers'
    (base `rotary_base_local`, unscaled, as Gemma 3's local RoPE). rope_type "yarn": YaRN's
    (mg.core.models.yarn; the tables then carry its concentration factor)."""
    dim = config.rotary_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    if local:
        return 1.0 / (config.rotary_base_local**exponents)
    if config.rope_type == "yarn":
        return yarn_inv_freq(config, dim, device=device)
    inv_freq = 1.0 / (config.rotary_base**exponents)
    if config.rope_scaling is not None:
        inv_freq = llama3_scale_inv_freq(inv_freq, config.rope_scaling)
    if config.rotary_seq_len_interpolation_factor is not None:  # HF "linear" RoPE
        inv_freq = inv_freq / config.rotary_seq_len_interpolation_factor
    return inv_freq


def _tables(position_ids: Tensor, inv_freq: Tensor, scale: float = 1.0) -> tuple[Tensor, Tensor]:
    """cos and sin of the angles, times `scale` (YaRN's concentration factor)."""
    freqs = position_ids.float()[..., None] * inv_freq  # [b, s, rotary_dim / 2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
    if scale == 1.0:
        return emb.cos(), emb.sin()
    return emb.cos() * scale, emb.sin() * scale


class RotaryEmbedding(nn.Module):
    """Computes the (cos, sin) tables for given positions; holds no state.

    With `rotary_base_local` (two RoPE bases, Gemma 3) the tables are four:
    (cos, sin, cos_local, sin_local), and each layer takes its pair
    (`layer_rotary`); the decoder passes the tuple along as it is."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config

    def forward(self, position_ids: Tensor) -> tuple[Tensor, ...]:
        """position_ids [b, s] → fp32 cos, sin [b, s, 1, rotary_dim] (broadcast over heads),
        then the local layers' pair where there is one."""
        device = position_ids.device
        scale = yarn_concentration_factor(self.config) if self.config.rope_type == "yarn" else 1.0
        tables = _tables(position_ids, rope_inv_freq(self.config, device=device), scale)
        if self.config.rotary_base_local is None:
            return tables
        return tables + _tables(position_ids, rope_inv_freq(self.config, device, local=True))


def layer_rotary(
    rotary: tuple[Tensor, ...] | None, window_layer: bool
) -> tuple[Tensor, Tensor] | None:
    """The (cos, sin) pair of one layer from `RotaryEmbedding`'s tables: the local pair
    for a sliding-window layer where there are two."""
    if rotary is None or len(rotary) == 2:
        return rotary
    return rotary[2:] if window_layer else rotary[:2]


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the first `rotary_dim` channels of x [b, s, heads, d]; the rest pass
    through unchanged (Megatron's `--rotary-percent` < 1). The tables are cast to
    x's dtype first, as Megatron and HF do."""
    rotary_dim = cos.shape[-1]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    x_rot = x_rot * cos + _rotate_half(x_rot) * sin
    return torch.cat((x_rot, x_pass), dim=-1) if x_pass.shape[-1] else x_rot
