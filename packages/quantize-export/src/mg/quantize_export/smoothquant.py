"""SmoothQuant (Xiao et al. 2022): move activation outliers into the weights before W8A8.

s_j = max|X_j|^α / max|W_j|^(1-α) per input channel j; x/s is easier to quantize per
token, W·diag(s) is still easy per channel. As in the reference ``smooth_lm``, the
linears fed by a norm are smoothed (linear_qkv by input_layernorm, linear_fc1 by
pre_mlp_layernorm) and 1/s is folded into the norm's weight (and bias), so the
smoothed model costs nothing extra at run time.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mg.core.models.norms import LayerNorm1P, RMSNorm1P


def smoothing_factors(act_absmax: Tensor, weight: Tensor, alpha: float) -> Tensor:
    """Per-input-channel s from calibration act-max [in] and the weight [out, in]."""
    w_max = weight.detach().float().abs().amax(dim=0).clamp(min=1e-5)
    a_max = act_absmax.float().clamp(min=1e-5)
    return (a_max.pow(alpha) / w_max.pow(1 - alpha)).clamp(min=1e-5)


@torch.no_grad()
def fold_into_norm(norm: nn.Module, linear: nn.Linear, scales: Tensor) -> None:
    """norm(x) / s feeds linear with weight W·diag(s): the same output, smoothed."""
    s = scales.to(norm.weight.dtype)
    if isinstance(norm, (LayerNorm1P, RMSNorm1P)):  # gamma = 1 + weight (--apply-layernorm-1p)
        norm.weight.add_(1).div_(s).sub_(1)
    else:
        norm.weight.div_(s)
    if getattr(norm, "bias", None) is not None:
        norm.bias.div_(scales.to(norm.bias.dtype))
    linear.weight.mul_(scales.to(linear.weight.dtype)[None, :])
