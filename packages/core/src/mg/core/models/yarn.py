"""YaRN RoPE scaling (Peng et al. 2023): Megatron-Core's `YarnRotaryEmbedding`, HF's "yarn".

A model trained with `original_max_position_embeddings` positions is stretched by
`rotary_scaling_factor`: the high-frequency channels (many turns over the original
context, more than `beta_fast`) keep their frequencies, the low-frequency ones (fewer
than `beta_slow` turns) are divided by the factor, and a linear ramp blends the band
between them. The cos/sin tables are then multiplied by a concentration factor
("mscale", "attention factor") so the attention logits keep their sharpness:

    mscale(s, m) = 0.1 · m · ln(s) + 1        (1 when s <= 1)
    concentration = mscale(s, mscale) / mscale(s, mscale_all_dim)

Multi-latent attention also multiplies its softmax scale by mscale(s, mscale_all_dim)²
(`mla_softmax_scale`), which is how DeepSeek-V3's mscale = mscale_all_dim = 1 ends with a
concentration of 1 and a sharper softmax. The formulas are Megatron-Core's
(`yarn_rotary_pos_embedding.py`); HF's `_compute_yarn_parameters` computes the same
frequencies (its `truncate` is `yarn_correction_range_round_to_int`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:  # the config imports this module for the MLA softmax scale
    from mg.core.models.config import TransformerConfig


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """0.1 · mscale · ln(scale) + 1, or 1 when the context is not stretched."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_concentration_factor(config: TransformerConfig) -> float:
    """The factor on the cos/sin tables: mscale(s, mscale) / mscale(s, mscale_all_dim)."""
    factor = config.rotary_scaling_factor
    return yarn_get_mscale(factor, config.mscale) / yarn_get_mscale(factor, config.mscale_all_dim)


def mla_softmax_scale(config: TransformerConfig, q_head_dim: int) -> float:
    """Multi-latent attention's softmax scale: mscale(s, mscale_all_dim)² / √q_head_dim
    (Megatron's `MultiLatentAttention.softmax_scale`; 1/√q_head_dim without YaRN)."""
    mscale = 1.0
    if config.rope_type == "yarn":
        mscale = yarn_get_mscale(config.rotary_scaling_factor, config.mscale_all_dim)
    return mscale * mscale / math.sqrt(q_head_dim)


def _correction_dim(num_rotations: float, dim: int, base: float, max_positions: int) -> float:
    """The channel whose wavelength turns `num_rotations` times over `max_positions`."""
    return (dim * math.log(max_positions / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def yarn_correction_range(config: TransformerConfig, dim: int) -> tuple[float, float]:
    """The channel band [low, high] over which the ramp goes from kept to interpolated."""
    base, positions = config.rotary_base, config.original_max_position_embeddings
    low = _correction_dim(config.beta_fast, dim, base, positions)
    high = _correction_dim(config.beta_slow, dim, base, positions)
    if config.yarn_correction_range_round_to_int:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def yarn_inv_freq(
    config: TransformerConfig, dim: int, device: torch.device | None = None
) -> Tensor:
    """YaRN's inverse frequencies [dim / 2] in fp32 for `dim` rotated channels."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim
    pos_freqs = config.rotary_base**exponents
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (config.rotary_scaling_factor * pos_freqs)
    low, high = yarn_correction_range(config, dim)
    if low == high:
        high += 0.001  # a one-channel band: avoid dividing by zero, as Megatron and HF do
    ramp = (torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)
    keep = 1.0 - ramp.clamp(0, 1)  # 1: the channel keeps its frequency (extrapolates)
    return interpolated * (1 - keep) + extrapolated * keep
