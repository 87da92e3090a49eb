"""GPTQ (Frantar et al. 2022): quantize a weight column by column, each column's rounding
error pushed onto the columns not yet quantized through the inverse Hessian of the
layer's reconstruction loss (H = 2 XᵀX / n over the calibration inputs).

Follows the reference implementation (IST-DASLab/gptq ``fasterquant``): dead input
channels zeroed, damping ``percdamp · mean(diag H)`` added to the diagonal, the upper
Cholesky factor of H⁻¹, lazy block updates. With act-order the columns are visited in
order of decreasing ``diag(H)``; the group scales are then computed once from the
original weight on contiguous groups (AutoGPTQ's ``static_groups``), so the result
keeps the plain grouped layout the int4 kernels read (no ``g_idx``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mg.core.quantization.primitives import check_group_size, int4_params


class HessianAccumulator:
    """Running H = 2/n · Σ x xᵀ over calibration rows (the reference's ``add_batch``)."""

    def __init__(self, columns: int) -> None:
        self.hessian = torch.zeros(columns, columns, dtype=torch.float64)
        self.rows = 0

    def add(self, x: Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).double()
        n = x.shape[0]
        self.hessian *= self.rows / (self.rows + n)
        self.rows += n
        x = x * (2.0 / self.rows) ** 0.5
        self.hessian += x.t() @ x


def gptq_quantize(
    weight: Tensor,
    hessian: Tensor,
    group_size: int,
    symmetric: bool = True,
    percdamp: float = 0.01,
    act_order: bool = False,
    block_size: int = 128,
) -> tuple[Tensor, Tensor, Tensor]:
    """[out, in] weight and [in, in] Hessian → (q 0..15 int8 [out, in], scale, zero [out, in/g])."""
    rows, columns = weight.shape
    check_group_size(columns, group_size)
    W = weight.detach().double().clone()
    H = hessian.detach().double().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0

    static = None
    perm = torch.arange(columns)
    if act_order:
        static = int4_params(W.float(), group_size, symmetric)
        perm = torch.argsort(torch.diag(H), descending=True)
        W, H = W[:, perm], H[perm][:, perm]

    H += percdamp * torch.mean(torch.diag(H)) * torch.eye(columns, dtype=H.dtype)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)

    Q = torch.zeros(rows, columns, dtype=torch.int8)
    scales = torch.zeros(rows, columns // group_size)
    zeros = torch.zeros(rows, columns // group_size, dtype=torch.int8)
    scale = zero = None
    for i1 in range(0, columns, block_size):
        i2 = min(i1 + block_size, columns)
        W1 = W[:, i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            column = int(perm[i1 + i])
            group = column // group_size
            if static is not None:
                scale, zero = static[0][:, group], static[1][:, group]
            elif (i1 + i) % group_size == 0:  # the reference reads the group from W here
                s, z = int4_params(
                    W[:, i1 + i : i1 + i + group_size].float(), group_size, symmetric
                )
                scale, zero = s[:, 0], z[:, 0]
            scales[:, group], zeros[:, group] = scale, zero
            w = W1[:, i]
            q = (torch.round(w / scale.double()) + zero.double()).clamp(0, 15)
            Q[:, column] = q.to(torch.int8)
            err = (w - (q - zero.double()) * scale.double()) / Hinv1[i, i]
            W1[:, i:] -= err[:, None] @ Hinv1[i, i:][None, :]
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    return Q, scales, zeros
