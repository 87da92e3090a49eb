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


def build_norm_1p(normalization: str, size: int, eps: float) -> nn.Module:
    """The zero-centred norm of `normalization` ("LayerNorm" or "RMSNorm")."""
    return RMSNorm1P(size, eps=eps) if normalization == "RMSNorm" else LayerNorm1P(size, eps=eps)
