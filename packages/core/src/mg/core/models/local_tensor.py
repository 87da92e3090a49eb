"""A parameter's local tensor, for modules that read their weights directly.

A module that runs `F.linear` on its own parameters (an MoE expert, the router,
a Mamba mixer's small parameters) works on plain tensors whether or not tensor
parallelism made them DTensors: `local(param)` is this rank's shard of a sharded
one, and of a replicated one the copy whose gradient is this rank's partial sum
(all-reduced over the group with the other partial gradients, as in
`mg.core.models.moe.tensor_parallel`).
"""

from __future__ import annotations

from torch import Tensor
from torch.distributed.tensor import DTensor, Partial


def local(tensor: Tensor) -> Tensor:
    """A parameter's local tensor: a sharded DTensor's shard, a replicated one's copy whose
    gradient is this rank's partial sum; a tensor itself."""
    if not isinstance(tensor, DTensor):
        return tensor
    if all(p.is_replicate() for p in tensor.placements):
        return tensor.to_local(grad_placements=[Partial()] * len(tensor.placements))
    return tensor.to_local()
