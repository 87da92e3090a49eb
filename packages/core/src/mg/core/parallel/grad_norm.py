"""Sums over tensors that may be DTensor shards: the gradient norm, and what the log adds.

`torch.nn.utils.clip_grad_norm_` cannot mix plain and DTensor gradients, and a
per-parameter `full_tensor()` would cost one collective per parameter. Here a
statistic of every sharded tensor's local part (the squares for a norm, the zeros
for `--log-num-zeros-in-grad`) is summed, all-reduced once per mesh and sharded
dims, and added to that of the replicated tensors (counted once, as every rank
holds all of them), which is Megatron's `get_grad_norm_fp32` and
`count_zeros_fp32` over the model-parallel group.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

LocalStat = Callable[[Tensor], Tensor]
"""A statistic of one local tensor, additive over its elements (a 0-d float64 tensor)."""


def squares(tensor: Tensor) -> Tensor:
    """The sum of squares (a norm's square), in float64."""
    return torch.linalg.vector_norm(tensor.double()) ** 2


def squares_in_dtype(tensor: Tensor) -> Tensor:
    """The sum of squares with the norm taken in the tensor's own dtype (as torch's
    `clip_grad_norm_`), without a float64 copy of the tensor; the result in float64."""
    return torch.linalg.vector_norm(tensor).double() ** 2


def zeros(tensor: Tensor) -> Tensor:
    """The number of zero elements (Megatron's `numel - count_nonzero`)."""
    return (tensor.numel() - torch.count_nonzero(tensor)).double()


def sharded_dims(tensor: Tensor) -> tuple[int, ...]:
    """The mesh dims a DTensor is sharded on (none for a plain or replicated tensor)."""
    if not isinstance(tensor, DTensor):
        return ()
    if any(p.is_partial() for p in tensor.placements):
        raise ValueError(
            f"a gradient is still a partial sum ({tensor.placements}); reduce it before the norm"
        )
    return tuple(i for i, p in enumerate(tensor.placements) if not p.is_replicate())


def global_sum(tensors: Iterable[Tensor], stat: LocalStat) -> float:
    """`stat` summed over tensors as if they were unsharded (the same on every rank).

    Every rank of a mesh must pass tensors of the same layouts (one collective per
    mesh and sharded dims)."""
    total = torch.zeros((), dtype=torch.float64)
    replicated: Tensor | None = None  # on the tensors' device: one host copy at the end
    sharded: dict[tuple[int, tuple[int, ...]], tuple[DeviceMesh, Tensor]] = {}
    for tensor in tensors:
        dims = sharded_dims(tensor)
        if not dims:
            value = stat(tensor.to_local() if isinstance(tensor, DTensor) else tensor)
            replicated = value if replicated is None else replicated + value.to(replicated)
            continue
        value = stat(tensor.to_local())
        key = (id(tensor.device_mesh), dims)
        mesh, acc = sharded.get(key, (tensor.device_mesh, torch.zeros_like(value)))
        sharded[key] = (mesh, acc + value)  # on the collective's device
    if replicated is not None:
        total += replicated.cpu()
    for (_, dims), (mesh, acc) in sharded.items():
        for dim in dims:
            dist.all_reduce(acc, group=mesh.get_group(dim))
        total += acc.cpu()
    return float(total)


def global_grad_norm(grads: Iterable[Tensor]) -> float:
    """L2 norm of all gradients as if they were unsharded (same value on every rank)."""
    return math.sqrt(global_sum(grads, squares))


@torch.no_grad()
def clip_grad_norm(parameters: Iterable[Tensor], max_norm: float) -> float:
    """Scale gradients so their global norm is at most `max_norm`; returns the norm
    before clipping (non-finite norms are returned and nothing is scaled)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    norm = global_grad_norm(grads)
    if max_norm > 0 and math.isfinite(norm):
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for grad in grads:
                (grad.to_local() if isinstance(grad, DTensor) else grad).mul_(coef)
    return norm
