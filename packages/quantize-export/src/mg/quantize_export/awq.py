"""AWQ (Lin et al. 2023): per-input-channel scales that protect the channels with large
activations before round-to-nearest int4.

For a linear y = x Wᵀ the search tries s = mean|x|^α for α on a grid (normalised by
√(max s · min s), as llm-awq does), quantizes W·diag(s), divides the scales back out and
keeps the α whose output is closest to the float output on the calibration rows. The
chosen s is then folded: the weight's columns are multiplied by s and the producer of
x (the preceding norm, or the up half of a gated fc1) divided by s, so the model
computes the same function with a weight that rounds better.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mg.core.quantization.primitives import dequantize_int4, quantize_int4


def fake_quantize_int4(weight: Tensor, group_size: int, symmetric: bool) -> Tensor:
    return dequantize_int4(*quantize_int4(weight, group_size, symmetric))


def search_awq_scales(
    weight: Tensor,
    inputs: Tensor,
    group_size: int,
    symmetric: bool = True,
    n_grid: int = 20,
) -> tuple[Tensor, float]:
    """[out, in] weight and calibration inputs [rows, in] → (scales [in], best α)."""
    x = inputs.reshape(-1, inputs.shape[-1]).float()
    w = weight.detach().float()
    reference = x @ w.t()
    x_mean = x.abs().mean(dim=0)
    best = (float("inf"), torch.ones_like(x_mean), 0.0)
    for step in range(n_grid):
        alpha = step / n_grid
        s = x_mean.pow(alpha).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        w_q = fake_quantize_int4(w * s, group_size, symmetric) / s
        loss = (reference - x @ w_q.t()).pow(2).mean().item()
        if loss < best[0]:
            best = (loss, s, alpha)
    return best[1], best[2]
