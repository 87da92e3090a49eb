"""Flat ranges of a (tensor-parallel) shard as boxes of the global tensor, against brute force.

The reference labels every element of a global tensor with its flat index, cuts
a rank's local shard out of it the way DTensor lays the placement out
(torch.chunk for Shard(d); [gate_r; up_r] for the gated fc1's
_StridedShard(0, split_factor=2)), takes a flat range of that shard and checks
that the pieces `global_pieces` returns are views of the range that, read at
their global offsets, hold exactly the range's labels, each once.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from mg.core.parallel.flat_shards import (
    Box,
    checkpoint_tensor,
    flat_range_boxes,
    global_pieces,
    placement_axis_map,
)


def _region(tensor: torch.Tensor, offsets: tuple[int, ...], sizes: tuple[int, ...]):
    return tensor[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]


def _ranges(numel: int, count: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    edges = [(0, numel), (0, 0), (numel, numel)] + [(0, 1), (numel - 1, numel)]
    for _ in range(count):
        a, b = sorted(rng.randint(0, numel) for _ in range(2))
        edges.append((a, b))
    return edges


@pytest.mark.parametrize("shape", [(11,), (5, 7), (1, 9), (6, 1), (3, 4, 5), ()])
def test_flat_range_boxes_cover_the_range_in_order(shape) -> None:
    labels = torch.arange(max(1, torch.Size(shape).numel())).view(shape)
    for start, stop in _ranges(labels.numel(), 60, seed=len(shape)):
        boxes = flat_range_boxes(start, stop, shape)
        got = [_region(labels, b.offsets, b.sizes).reshape(-1) for b in boxes]
        flat = torch.cat(got) if got else torch.empty(0, dtype=labels.dtype)
        assert torch.equal(flat, torch.arange(start, stop)), (shape, start, stop, boxes)
        assert len(boxes) <= max(1, 2 * (len(shape) - 1) + 1)


def test_a_two_d_range_is_partial_row_whole_rows_partial_row() -> None:
    assert flat_range_boxes(5, 26, (5, 7)) == [
        Box((0, 5), (1, 2)),
        Box((1, 0), (2, 7)),
        Box((3, 0), (1, 5)),
    ]
    assert flat_range_boxes(7, 21, (5, 7)) == [Box((1, 0), (2, 7))]
    assert flat_range_boxes(8, 10, (5, 7)) == [Box((1, 1), (1, 2))]


def _local_shard(global_: torch.Tensor, placement, n: int, r: int) -> torch.Tensor:
    """The brute-force local shard of rank r of n (DTensor's layout)."""
    if isinstance(placement, _StridedShard):
        halves = global_.chunk(placement.split_factor, dim=placement.dim)
        return torch.cat([h.chunk(n, dim=placement.dim)[r] for h in halves], dim=placement.dim)
    if isinstance(placement, Shard):
        return global_.chunk(n, dim=placement.dim)[r]
    return global_


CASES = [
    ((13,), Replicate(), 1),
    ((12,), Shard(0), 2),
    ((10,), Shard(0), 4),  # uneven: torch.chunk gives 3, 3, 3, 1
    ((8, 6), Shard(0), 2),
    ((8, 6), Shard(1), 2),
    ((6, 9), Shard(1), 3),
    ((6, 5), Replicate(), 2),
    ((16, 5), _StridedShard(0, split_factor=2), 2),  # gated fc1: [gate; up] rows
    ((24, 3), _StridedShard(0, split_factor=2), 4),
]


@pytest.mark.parametrize(("shape", "placement", "n"), CASES)
def test_global_pieces_match_brute_force(shape, placement, n) -> None:
    labels = torch.arange(torch.Size(shape).numel(), dtype=torch.float64).view(shape)
    for r in range(n):
        local = _local_shard(labels, placement, n, r).contiguous()
        axis = placement_axis_map(placement, shape, n, r)
        for start, stop in _ranges(local.numel(), 40, seed=r):
            if start == stop:
                continue
            flat = local.reshape(-1)[start:stop].clone()
            pieces = global_pieces(flat, start, tuple(local.shape), axis)
            seen = []
            for piece, offsets in pieces:
                assert piece.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
                expected = _region(labels, offsets, tuple(piece.shape))
                assert torch.equal(piece, expected), (shape, placement, r, start, stop)
                seen.append(piece.reshape(-1))
            got = torch.cat(seen).sort().values
            assert torch.equal(got, flat.sort().values)  # every element once


@pytest.mark.parametrize(("shape", "placement", "n"), CASES)
def test_every_element_is_owned_once_across_ranks_and_ranges(shape, placement, n) -> None:
    """Ranks split their local shards into data-parallel ranges (a bucket shard each):
    together the pieces tile the global tensor without overlap (what DCP requires)."""
    numel = torch.Size(shape).numel()
    owner = torch.zeros(shape, dtype=torch.int64)
    replicas = n if placement.is_replicate() else 1
    for r in range(n // replicas):
        labels = torch.zeros(shape)
        local = _local_shard(labels, placement, n, r).contiguous()
        axis = placement_axis_map(placement, shape, n, r)
        cuts = sorted(
            {
                0,
                local.numel(),
                *random.Random(r).sample(range(local.numel()), min(3, local.numel())),
            }
        )
        for a, b in itertools.pairwise(cuts):
            for piece, offsets in global_pieces(local.reshape(-1)[a:b], a, local.shape, axis):
                _region(owner, offsets, tuple(piece.shape)).add_(1)
    assert owner.sum() == numel and bool((owner == 1).all())


def test_checkpoint_tensor_of_the_whole_tensor_is_the_view_itself() -> None:
    flat = torch.arange(6.0)
    (piece,) = global_pieces(flat, 0, (2, 3), None)
    assert checkpoint_tensor([piece], (2, 3), None) is piece[0]
    with pytest.raises(ValueError, match="device mesh"):
        checkpoint_tensor(global_pieces(flat[:4], 0, (2, 3), None), (2, 3), None)
