"""The global gradient norm and clipping when some gradients are DTensor shards.

`torch.nn.utils.clip_grad_norm_` cannot mix plain and DTensor gradients, and a
per-parameter `full_tensor()` would cost one collective per parameter. Here
the squares of every sharded gradient's local part are summed, all-reduced
once per mesh, and added to the squares of the replicated gradients (counted
once, as every rank holds all of them), which is Megatron's
`get_grad_norm_fp32` over the model-parallel group.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor


def _is_sharded(grad: DTensor) -> bool:
    if any(p.is_partial() for p in grad.placements):
        raise ValueError(
            f"a gradient is still a partial sum ({grad.placements}); reduce it before the norm"
        )
    return any(not p.is_replicate() for p in grad.placements)


def global_grad_norm(grads: Iterable[Tensor]) -> float:
    """L2 norm of all gradients as if they were unsharded (same value on every rank)."""
    local_sq = torch.zeros((), dtype=torch.float64)
    sharded_sq: dict[int, tuple[DTensor, Tensor]] = {}
    for grad in grads:
        if isinstance(grad, DTensor):
            sq = torch.linalg.vector_norm(grad.to_local().double()) ** 2
            if _is_sharded(grad):
                key = id(grad.device_mesh)
                mesh_grad, total = sharded_sq.get(key, (grad, torch.zeros_like(sq)))
                sharded_sq[key] = (mesh_grad, total + sq)  # on the collective's device
                continue
            local_sq += sq.cpu()
        else:
            local_sq += (torch.linalg.vector_norm(grad.double()) ** 2).cpu()
    for mesh_grad, total in sharded_sq.values():
        # Sharded over every dim of its mesh (a 1-D tensor-parallel mesh here).
        dist.all_reduce(total, group=mesh_grad.device_mesh.get_group())
        local_sq += total.cpu()
    return math.sqrt(float(local_sq))


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
