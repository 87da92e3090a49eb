"""AWQ (Lin et al. 2023): per-input-channel scales that protect the channels with large
activations before round-to-nearest int4.

For a linear y = x Wᵀ the search tries s = mean|x|^α for α on a grid (normalised
by √(max s · min s), as llm-awq does; mg-quantize also tries AutoAWQ's duo form
mean|x|^α / mean|ŵ|^(1-α) at each α and keeps the better), quantizes W·diag(s),
divides the scales back out and keeps the α whose output is closest to the float
output on the calibration rows. The chosen s is then folded: the weight's columns
are multiplied by s and the producer of x (the preceding norm, or the up half of a
gated fc1) divided by s, so the model computes the same function with a weight that
rounds better. The attention output's scales fold into the value rows of
``linear_qkv`` where every query head has its own value head (AutoAWQ's v_proj →
o_proj); with grouped queries it stays plain int4.

With ``--awq-clip`` the scaled weights are then clipped as AutoAWQ / llm-compressor's
``apply_clip`` does: per group, a max |w| shrunk by up to half is searched for the
smallest output error (outliers clipped, the rest of the group rounded finer). The
fused ``linear_qkv`` is not clipped (AutoAWQ skips q/k: clipping them moves the
attention scores).
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
    duo_scaling: bool | str = False,
) -> tuple[Tensor, float]:
    """[out, in] weight and calibration inputs [rows, in] → (scales [in], best α).

    `duo_scaling` True searches AutoAWQ's s = mean|x|^α / mean|ŵ|^(1-α) (ŵ: each weight
    over its group's max |w|), which also weighs the channels whose weights are large;
    "both" tries either form at every α and keeps the better (never worse than either)."""
    x = inputs.reshape(-1, inputs.shape[-1]).float()
    w = weight.detach().float()
    reference = x @ w.t()
    x_mean = x.abs().mean(dim=0)
    groups = w.abs().view(-1, group_size)
    w_mean = (groups / (groups.amax(dim=1, keepdim=True) + 1e-6)).view(w.shape).mean(dim=0)
    forms = {False: (False,), True: (True,), "both": (False, True)}[duo_scaling]
    best = (float("inf"), torch.ones_like(x_mean), 0.0)
    for step in range(n_grid):
        alpha = step / n_grid
        for duo in forms:
            s = x_mean.pow(alpha)
            if duo:
                s = s / (w_mean.pow(1 - alpha) + 1e-4)
            s = s.clamp(min=1e-4)
            s = s / (s.max() * s.min()).sqrt()
            w_q = fake_quantize_int4(w * s, group_size, symmetric) / s
            loss = (reference - x @ w_q.t()).pow(2).mean().item()
            if loss < best[0]:
                best = (loss, s, alpha)
    return best[1], best[2]


@torch.no_grad()
def search_awq_clip(
    weight: Tensor,
    inputs: Tensor,
    group_size: int,
    symmetric: bool = True,
    n_grid: int = 20,
    max_shrink: float = 0.5,
    n_sample_token: int = 512,
    rows_per_batch: int = 1024,
) -> Tensor:
    """AWQ's weight-clipping search (AutoAWQ's ``_compute_best_clip``): for each group of
    each output row, the max |w| in {amax · (1 − i/n_grid) : i < max_shrink · n_grid}
    whose round-to-nearest int4 weight, clamped to ±max, gives the smallest mean squared
    error of that group's share of the output on (a subsample of) the calibration rows.

    [out, in] weight and inputs [rows, in] → max values [out, in / group_size].
    """
    out, inp = weight.shape
    groups = inp // group_size
    x = inputs.reshape(-1, inp).float()
    x = x[:: max(1, len(x) // n_sample_token)]
    xg = x.reshape(len(x), groups, group_size).transpose(0, 1)  # groups, tokens, g

    def partial_outputs(
        w: Tensor,
    ) -> Tensor:  # [rows, in] → each group's share [rows, groups, tokens]
        wg = w.reshape(len(w), groups, group_size).permute(1, 2, 0)  # groups, g, rows
        return torch.bmm(xg, wg).permute(2, 0, 1)

    best_all = []
    for start in range(0, out, rows_per_batch):
        w = weight[start : start + rows_per_batch].float()
        amax = w.reshape(len(w), groups, group_size).abs().amax(dim=-1)  # rows, groups
        reference = partial_outputs(w)
        best = amax.clone()
        least = torch.full_like(amax, float("inf"))
        for step in range(int(max_shrink * n_grid)):
            max_val = amax * (1 - step / n_grid)
            limit = max_val.repeat_interleave(group_size, dim=1)
            clipped = torch.maximum(torch.minimum(w, limit), -limit)
            w_q = fake_quantize_int4(clipped, group_size, symmetric)
            err = (partial_outputs(w_q) - reference).pow_(2).mean(dim=-1)
            better = err < least
            least[better] = err[better]
            best[better] = max_val[better]
        best_all.append(best)
    return torch.cat(best_all)


@torch.no_grad()
def apply_awq_clip(weight: Tensor, max_val: Tensor) -> None:
    """Clamp each group of ``weight`` [out, in] to ±``max_val`` [out, in / g], in place."""
    out, inp = weight.shape
    limit = max_val.to(weight.dtype).repeat_interleave(inp // max_val.shape[1], dim=1)
    weight.copy_(torch.maximum(torch.minimum(weight, limit), -limit))
