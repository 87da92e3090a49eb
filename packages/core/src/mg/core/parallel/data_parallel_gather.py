"""All-gather of per-sample rows over the data-parallel ranks, differentiable.

In-batch negatives (the ICT bi-encoder's blocks) span the global micro-batch:
each rank needs every rank's embeddings in the forward pass, and the gradient
each rank computes for the gathered rows must reach the rank that produced
them. `gather_from_data_parallel(x, group)` concatenates every rank's `x`
along dim 0 in rank order; its backward sums the gradient of the gathered
rows over the ranks and keeps this rank's rows (a reduce-scatter), because
each rank's loss touches every rank's rows.

Megatron's pretrain_ict.py (`AllgatherFromDataParallelRegion`) gathers the
queries too and has every rank compute the whole global batch's loss, so
there the backward is a plain slice; here each rank scores its own queries
only and the reduce-scatter brings the other ranks' share (see
`mg.trainer.family_ict` for why the gradients are the one-process ones).

Collective rules (NCCL as gloo): `x` is on the rank's device, every rank
gathers the same number of rows, and every rank calls it (and so runs its
backward) at the same point of the same graph.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


class _GatherFromDataParallel(torch.autograd.Function):
    """Forward: all-gather rows; backward: reduce-scatter the rows' gradient."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        out = x.new_empty(x.shape[0] * size, *x.shape[1:])
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        size = dist.get_world_size(ctx.group)
        out = grad.new_empty(grad.shape[0] // size, *grad.shape[1:])
        dist.reduce_scatter_tensor(out, grad.contiguous(), group=ctx.group)
        return out, None


def gather_from_data_parallel(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """[rows, ...] on each rank → [rows × ranks, ...], rank 0's rows first; the gradient
    of the gathered rows is summed over the ranks back onto each rank's own rows."""
    return _GatherFromDataParallel.apply(x, group)
