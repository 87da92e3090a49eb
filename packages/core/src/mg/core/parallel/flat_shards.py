"""A flat range of a parameter's shard as boxes of the parameter's global tensor.

The distributed optimizer owns, per parameter, one contiguous range of the
flattened local (tensor-parallel) shard: its slice of a padded bucket. To
checkpoint that state without gathering it, each rank describes its range in
the coordinates of the whole, unsharded parameter, so that a checkpoint
(torch.distributed.checkpoint) stores one global tensor per parameter and
state key, whatever the data-, tensor- or pipeline-parallel layout that wrote
it, and any layout reads back just the regions it owns.

Two steps:

1. `flat_range_boxes`: a flat range [start, stop) of a C-contiguous tensor is
   at most 2·(ndim−1)+1 boxes, in flat order (in 2-D: a partial first row, the
   whole rows, a partial last row). Each box is contiguous in memory, so it is a
   *view* of the flat state (`flat[a:b].view(sizes)`): nothing is copied.
2. `AxisMap` / `axis_map_of`: where the local shard's indices along its
   sharded dimension lie in the global tensor, from the DTensor placement:
   `Shard(d)` is one run, `_StridedShard(d, split_factor=f)` (the gated MLP's
   [gate_r; up_r] rows) is f runs that land in f separate global blocks, and
   a replicated or plain tensor maps to itself. A box that crosses the border
   of two runs is split there.

`checkpoint_tensor` hands the pieces to DCP: a DTensor whose local tensor is a
`LocalShardsWrapper` listing each piece with its global offset (DCP writes and
reads such chunks as they are; the mesh only has to contain this rank), or the
plain view when one piece is the whole tensor. (A ShardedTensor would do too,
but it is built either from every rank's shard metadata, checked to cover the
tensor, or with one collective per tensor; the wrapper needs only this rank's
pieces, and `dist_format` already writes strided shards that way.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from mg.core.checkpoint.global_chunks import GlobalChunks, own_storage
from mg.core.parallel.row_blocks import row_blocks, row_runs


@dataclass(frozen=True)
class Box:
    """A rectangular block of a tensor: its first index and its size in every dimension."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def flat_range_boxes(start: int, stop: int, shape: tuple[int, ...]) -> list[Box]:
    """The boxes that elements [start, stop) of a C-contiguous tensor of `shape` form.

    In flat order and each contiguous in memory, so consecutive slices of the
    flat range are views of the boxes' shapes. A 1-D range is one box; a 2-D
    range at most three (partial first row, whole rows, partial last row); in
    general at most 2·(ndim−1)+1.
    """
    shape = tuple(shape)
    if not 0 <= start <= stop <= math.prod(shape):
        raise ValueError(f"range [{start}, {stop}) is outside a tensor of shape {shape}")
    if start == stop:
        return []
    if not shape:
        return [Box((), ())]
    if len(shape) == 1:
        return [Box((start,), (stop - start,))]
    inner = math.prod(shape[1:])
    row0, col0 = divmod(start, inner)
    row1, col1 = divmod(stop, inner)
    if row0 == row1:  # within one row (one slab of the leading dimension)
        return _in_row(row0, flat_range_boxes(col0, col1, shape[1:]))
    boxes: list[Box] = []
    if col0:  # the first row's tail
        boxes += _in_row(row0, flat_range_boxes(col0, inner, shape[1:]))
        row0 += 1
    if row1 > row0:  # whole rows
        boxes.append(Box((row0, *[0] * (len(shape) - 1)), (row1 - row0, *shape[1:])))
    if col1:  # the last row's head
        boxes += _in_row(row1, flat_range_boxes(0, col1, shape[1:]))
    return boxes


def _in_row(row: int, boxes: list[Box]) -> list[Box]:
    return [Box((row, *b.offsets), (1, *b.sizes)) for b in boxes]


@dataclass(frozen=True)
class AxisMap:
    """Where a local shard's indices along `dim` lie in the global tensor.

    `runs` are (local start, length, global start): local indices
    [ls, ls + length) are global [gs, gs + length); the other dimensions are
    not sharded, so their indices are the same in both."""

    dim: int
    runs: tuple[tuple[int, int, int], ...]


def axis_map_of(param: Tensor) -> AxisMap | None:
    """The local → global map of a DTensor parameter's local shard (1-D mesh);
    None where the local tensor is the whole tensor (plain or replicated)."""
    if not isinstance(param, DTensor):
        return None
    mesh = param.device_mesh
    if mesh.ndim != 1:
        raise NotImplementedError("flat-range checkpoints support a 1-D tensor-parallel mesh")
    blocks = row_blocks(param)
    if blocks is not None:  # a slice of each row block (mg.core.parallel.row_blocks)
        return AxisMap(0, tuple(row_runs(blocks, mesh.size(), mesh.get_local_rank())))
    (placement,) = param.placements
    return placement_axis_map(placement, tuple(param.shape), mesh.size(), mesh.get_local_rank())


def placement_axis_map(
    placement: Placement, global_shape: tuple[int, ...], mesh_size: int, rank: int
) -> AxisMap | None:
    """`axis_map_of` for rank `rank` of a 1-D mesh of `mesh_size`, from the placement:
    Shard(d) is torch.chunk's split of dim d; _StridedShard(d, f) splits dim d into
    f·n blocks of which rank r holds r, n + r, … (a gated fc1's [gate_r; up_r])."""
    if placement.is_replicate():
        return None
    n, ndim = mesh_size, len(global_shape)
    if isinstance(placement, _StridedShard):
        dim, factor = placement.dim % ndim, placement.split_factor
        if global_shape[dim] % (factor * n):
            raise NotImplementedError(f"uneven strided shards of shape {global_shape}")
        piece = global_shape[dim] // (factor * n)
        return AxisMap(
            dim, tuple((j * piece, piece, (j * n + rank) * piece) for j in range(factor))
        )
    if isinstance(placement, Shard):
        dim = placement.dim % ndim
        size, offset = placement._local_shard_size_and_offset(global_shape[dim], n, rank)
        return AxisMap(dim, ((0, size, offset),))
    raise NotImplementedError(f"no flat-range checkpoint for placement {placement}")


def to_global(box: Box, axis: AxisMap | None) -> list[tuple[Box, Box]]:
    """(local part, global box) pairs for a local box: split where it crosses runs."""
    if axis is None:
        return [(box, box)]
    d = axis.dim
    lo, hi = box.offsets[d], box.offsets[d] + box.sizes[d]
    out = []
    for local_start, length, global_start in axis.runs:
        a, b = max(lo, local_start), min(hi, local_start + length)
        if a >= b:
            continue
        local = _with_dim(box, d, a, b - a)
        out.append((local, _with_dim(box, d, global_start + a - local_start, b - a)))
    return out


def _with_dim(box: Box, dim: int, offset: int, size: int) -> Box:
    offsets, sizes = list(box.offsets), list(box.sizes)
    offsets[dim], sizes[dim] = offset, size
    return Box(tuple(offsets), tuple(sizes))


def global_pieces(
    flat: Tensor, start: int, local_shape: tuple[int, ...], axis: AxisMap | None
) -> list[tuple[Tensor, tuple[int, ...]]]:
    """Views of `flat` (elements start … start+len(flat) of the local shard) with their
    global offsets: the chunks this rank stores of the parameter's global tensor."""
    pieces = []
    pos = 0
    for box in flat_range_boxes(start, start + flat.numel(), tuple(local_shape)):
        view = flat[pos : pos + box.numel].view(box.sizes)
        pos += box.numel
        for local, global_box in to_global(box, axis):
            if axis is not None:
                d = axis.dim
                view_part = view.narrow(d, local.offsets[d] - box.offsets[d], local.sizes[d])
            else:
                view_part = view
            pieces.append((view_part, global_box.offsets))
    return pieces


def checkpoint_tensor(
    pieces: list[tuple[Tensor, tuple[int, ...]]],
    global_shape: tuple[int, ...],
    mesh: DeviceMesh | None,
) -> Tensor:
    """The pieces as one tensor DCP saves into (and loads from) the global tensor.

    One piece that is the whole tensor is returned as it is; otherwise a
    DTensor over `mesh` (any mesh containing this rank: DCP only reads the
    pieces' offsets) wrapping the pieces. Views stay views: a load fills them.
    """
    global_shape = tuple(global_shape)
    if not pieces:
        raise ValueError("no pieces: leave a tensor this rank holds nothing of out")
    if len(pieces) == 1 and tuple(pieces[0][0].shape) == global_shape:
        return pieces[0][0]
    if len(global_shape) > 2:
        # LocalShardsWrapper has no views beyond 2-D (a Mamba mixer's conv1d weight is
        # [channels, 1, width]); DCP's checkpointable protocol takes the pieces as they are
        return GlobalChunks(global_shape, [(own_storage(p), o) for p, o in pieces])
    if mesh is None:
        raise ValueError(
            "a part of a tensor needs a device mesh (an initialized process group) to be "
            "checkpointed"
        )
    wrapper = LocalShardsWrapper([p for p, _ in pieces], [o for _, o in pieces])
    return DTensor.from_local(
        wrapper,
        mesh,
        [Shard(0)],
        run_check=False,
        shape=torch.Size(global_shape),
        stride=_contiguous_strides(global_shape),
    )


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))
