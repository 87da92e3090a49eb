"""Quantize and dequantize weights and activations: the arithmetic, nothing else.

Conventions (those of compressed-tensors, so an HF export is a re-labelling,
not a re-quantization):

- int8, symmetric per output channel: ``scale = amax / 127``,
  ``q = clamp(round(w / scale), -128, 127)``.
- int4, per group of ``group_size`` input columns, stored unsigned ``q ∈ [0, 15]``
  with an integer zero point ``z`` so that ``w ≈ (q - z) * scale``:
  symmetric ``scale = amax / 7.5``, ``z = 8``;
  asymmetric ``scale = (max - min) / 15`` over ``[min(w, 0), max(w, 0)]``,
  ``z = clamp(round(-min / scale), 0, 15)``.
- fp8 E4M3: ``scale = amax / 448`` per tensor or per output channel.
- Activations: int8 per token (row), dynamic; fp8 per tensor, static (a calibrated amax).

Rounding is round-half-to-even (`torch.round`) everywhere.
"""

from __future__ import annotations

import torch
from torch import Tensor

INT4_GROUP_SIZES = (32, 64, 128)
FP8_MAX = 448.0
_TINY = 1e-12


class QuantizationError(ValueError):
    """A tensor cannot be quantized as asked (shape, group size)."""


def quantize_int8_per_channel(weight: Tensor) -> tuple[Tensor, Tensor]:
    """[out, in] float → (int8 [out, in], fp32 scale [out])."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=_TINY)
    q = torch.round(w / scale[:, None]).clamp(-128, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: Tensor, scale: Tensor) -> Tensor:
    return q.float() * scale.float()[:, None]


def check_group_size(in_features: int, group_size: int, name: str = "weight") -> None:
    if group_size <= 0 or in_features % group_size:
        raise QuantizationError(
            f"{name}: group size {group_size} does not divide its {in_features} input "
            f"features; pick a group size that does (one of {INT4_GROUP_SIZES})"
        )


def int4_params(weight: Tensor, group_size: int, symmetric: bool) -> tuple[Tensor, Tensor]:
    """The scales and integer zero points [out, in / group] of a weight's groups."""
    out, inp = weight.shape
    check_group_size(inp, group_size)
    groups = weight.float().reshape(out, inp // group_size, group_size)
    if symmetric:
        scale = (groups.abs().amax(dim=2) / 7.5).clamp(min=_TINY)
        zero = torch.full_like(scale, 8, dtype=torch.int8)
    else:
        low = groups.amin(dim=2).clamp(max=0)
        high = groups.amax(dim=2).clamp(min=0)
        scale = ((high - low) / 15.0).clamp(min=_TINY)
        zero = torch.round(-low / scale).clamp(0, 15).to(torch.int8)
    return scale, zero


def quantize_int4_with(weight: Tensor, scale: Tensor, zero: Tensor) -> Tensor:
    """Round a weight onto given group scales / zero points → int8 [out, in] values in 0..15."""
    out, inp = weight.shape
    group_size = inp // scale.shape[1]
    s = scale.repeat_interleave(group_size, dim=1)
    z = zero.float().repeat_interleave(group_size, dim=1)
    return (torch.round(weight.float() / s) + z).clamp(0, 15).to(torch.int8)


def quantize_int4(
    weight: Tensor, group_size: int, symmetric: bool = True
) -> tuple[Tensor, Tensor, Tensor]:
    """[out, in] float → (q 0..15 as int8 [out, in], scale [out, in/g], zero int8 [out, in/g])."""
    scale, zero = int4_params(weight, group_size, symmetric)
    return quantize_int4_with(weight, scale, zero), scale, zero


def dequantize_int4(q: Tensor, scale: Tensor, zero: Tensor) -> Tensor:
    group_size = q.shape[1] // scale.shape[1]
    s = scale.float().repeat_interleave(group_size, dim=1)
    z = zero.float().repeat_interleave(group_size, dim=1)
    return (q.float() - z) * s


def pack_int4(q: Tensor) -> Tensor:
    """[out, in] values 0..15 → uint8 [out, in / 2]: column 2j low nibble, 2j+1 high nibble."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: Tensor) -> Tensor:
    """uint8 [out, in / 2] → int8 [out, in] values 0..15 (inverse of :func:`pack_int4`)."""
    low = (packed & 0x0F).to(torch.int8)
    high = (packed >> 4).to(torch.int8)
    return torch.stack([low, high], dim=2).reshape(packed.shape[0], -1)


def quantize_fp8(weight: Tensor, per_channel: bool) -> tuple[Tensor, Tensor]:
    """[out, in] float → (float8_e4m3fn [out, in], fp32 scale [out] or scalar)."""
    w = weight.float()
    amax = w.abs().amax(dim=1) if per_channel else w.abs().amax()
    scale = (amax / FP8_MAX).clamp(min=_TINY)
    s = scale[:, None] if per_channel else scale
    return (w / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def dequantize_fp8(q: Tensor, scale: Tensor) -> Tensor:
    s = scale.float()[:, None] if scale.dim() == 1 else scale.float()
    return q.float() * s


def fake_quantize_fp8_activation(x: Tensor, scale: Tensor) -> Tensor:
    """x rounded through E4M3 with a static per-tensor scale (values beyond amax saturate)."""
    s = scale.to(x.dtype)
    return (x / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(x.dtype) * s


def quantize_int8_per_token(x: Tensor) -> tuple[Tensor, Tensor]:
    """[..., in] → (int8 [..., in], fp32 scale [..., 1]): each row its own amax / 127."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / 127.0).clamp(min=_TINY)
    return torch.round(xf / scale).clamp(-128, 127).to(torch.int8), scale
