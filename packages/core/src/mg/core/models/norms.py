"""Zero-centred norms: Megatron's `--apply-layernorm-1p` (`layernorm_zero_centered_gamma`).

The stored weight is gamma - 1: it starts at 0 and the norm scales by
1 + weight, as Megatron's FusedLayerNorm and Transformer Engine's
`zero_centered_gamma` do (LayerNorm and RMSNorm alike). A checkpoint's norm
weights are therefore Megatron's own numbers for such a model, names unchanged.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


class LayerNorm1P(nn.LayerNorm):
    """LayerNorm computing with 1 + weight; the weight (and bias) start at 0."""

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


class RMSNorm1P(nn.RMSNorm):
    """RMSNorm computing with 1 + weight; the weight starts at 0."""

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, self.normalized_shape, self.weight + 1, self.eps)


class RMSNorm1PFP32(RMSNorm1P):
    """Gemma's RMSNorm: x·rsqrt(mean(x²) + eps)·(1 + weight) computed in fp32 and cast
    back to x's dtype (HF `Gemma3RMSNorm`), so 1 + weight is never rounded to bf16."""

    def forward(self, x: Tensor) -> Tensor:
        weight = self.weight.float() + 1
        return F.rms_norm(x.float(), self.normalized_shape, weight, self.eps).type_as(x)


def build_norm_1p(normalization: str, size: int, eps: float, fp32: bool = False) -> nn.Module:
    """The zero-centred norm of `normalization` ("LayerNorm" or "RMSNorm"); `fp32`: an
    RMSNorm that computes in fp32 whatever its input (Gemma's)."""
    if normalization == "RMSNorm":
        return RMSNorm1PFP32(size, eps=eps) if fp32 else RMSNorm1P(size, eps=eps)
    return LayerNorm1P(size, eps=eps)
