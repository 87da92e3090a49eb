"""Tensor-parallel shards that take a slice of each of several row blocks.

Megatron-Core's MambaMixer splits its fused projections by heads and groups:
`in_proj.weight` is [z; x; B; C; dt] (d_inner, d_inner, G·N, G·N, heads rows)
and tensor-parallel rank r of n holds [z_r; x_r; B_r; C_r; dt_r], the r-th
n-th of every block; `conv1d.weight` and `conv1d.bias` ([x; B; C] channels)
likewise. Megatron's `torch` checkpoint `mp_rank_0r` stores exactly that local
tensor; the whole tensor is the blocks side by side.

DTensor has no placement for unequal blocks (`_StridedShard` cuts equal ones),
so such a parameter is a `Shard(0)` DTensor of the rank-ordered concatenation
of the local shards: its local tensor, the computation and its gradient are
Megatron's, but its global view is the rows permuted. The parameter carries
its blocks' whole sizes (`ROW_BLOCKS`), and the few places that translate
between a shard and the whole tensor read them: initialisation
(`materialize.copy_shard`), checkpoints (`dist_format.dtensor_pieces`,
`flat_shards.axis_map_of`, `tp_merge`). Nothing calls `full_tensor()` on one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

ROW_BLOCKS = "_mg_tp_row_blocks"
"""Attribute of a parameter (or a state tensor of one): its row blocks' whole sizes."""


def row_blocks(tensor: Tensor) -> tuple[int, ...] | None:
    """The row blocks a tensor-parallel parameter is sharded by, if it is one of these."""
    return getattr(tensor, ROW_BLOCKS, None)


def row_runs(blocks: Sequence[int], n: int, rank: int) -> list[tuple[int, int, int]]:
    """(local first row, rows, whole first row) of each block's slice held by `rank` of `n`."""
    runs, local, whole = [], 0, 0
    for size in blocks:
        if size % n:
            raise ValueError(f"row block of {size} rows does not split over {n} ranks")
        piece = size // n
        runs.append((local, piece, whole + rank * piece))
        local += piece
        whole += size
    return runs


def local_rows(full: Tensor, blocks: Sequence[int], n: int, rank: int) -> Tensor:
    """Rank `rank`'s shard of the whole tensor `full`: its slice of every block, in order."""
    return torch.cat([full.narrow(0, start, rows) for _, rows, start in row_runs(blocks, n, rank)])


def merge_rows(shards: Sequence[Tensor], blocks: Sequence[int]) -> Tensor:
    """The whole tensor from the shards of ranks 0..n-1 (Megatron's mp_rank files, in order)."""
    n = len(shards)
    runs = row_runs(blocks, n, 0)
    return torch.cat(
        [shard.narrow(0, local, rows) for local, rows, _ in runs for shard in shards], dim=0
    )


def split_rows(full: Tensor, blocks: Sequence[int], n: int) -> list[Tensor]:
    """The shards of ranks 0..n-1 of the whole tensor (`merge_rows`'s inverse)."""
    return [local_rows(full, blocks, n, r) for r in range(n)]


def shard_row_blocks(module: nn.Module, name: str, mesh: DeviceMesh, blocks: Sequence[int]) -> None:
    """Make `module.<name>` this rank's row-block shard, a Shard(0) DTensor marked with its
    blocks. A meta parameter gets a meta shard (materialize fills it later)."""
    param = getattr(module, name)
    n, rank = mesh.size(), mesh.get_local_rank()
    local = local_rows(param.detach(), blocks, n, rank).contiguous()
    dtensor = DTensor.from_local(
        local, mesh, [Shard(0)], run_check=False, shape=param.shape, stride=param.stride()
    )
    new = nn.Parameter(dtensor, requires_grad=param.requires_grad)
    setattr(new, ROW_BLOCKS, tuple(blocks))
    module.register_parameter(name, new)
