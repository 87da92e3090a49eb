"""A local shard wrapped as a DTensor of another tensor's layout (mesh, placements, shape)."""

from __future__ import annotations

from torch import Tensor
from torch.distributed.tensor import DTensor


def shard_like(local: Tensor, reference: Tensor) -> Tensor:
    """`local` as a DTensor laid out like `reference` (its global shape and stride too, so
    uneven and strided shards keep their meaning); `local` itself when `reference` is a
    plain tensor. Used where optimizer state or a copied shard must look like its
    parameter to checkpoints and DCP."""
    if not isinstance(reference, DTensor):
        return local
    return DTensor.from_local(
        local,
        reference.device_mesh,
        reference.placements,
        run_check=False,
        shape=reference.shape,
        stride=reference.stride(),
    )
