"""What torch.distributed.checkpoint (DCP) is handed for a rank's tensors: pieces of global ones.

A `torch_dist` checkpoint stores every tensor once, with its global shape; each
rank says which pieces of it it holds and where they sit. `GlobalChunks` is that
statement for one key (torch DCP's checkpointable-tensor protocol, as
Megatron-Core's `CheckpointableShardedTensor`): a wrapper tensor of the global
shape holding no data of its own, whose pieces are views of the rank's tensors,
so a save copies nothing and a load writes into the model.

`tensor_pieces` turns a plain tensor (whole) or a DTensor (its local shard, a
`_StridedShard`'s chunks, a row-blocked shard's runs) into such pieces;
`dcp_ready` does it for a nested state dict. Every piece is a view over a storage
of exactly its bytes (`own_storage`): DCP's writer would otherwise clone a view
into a larger buffer (the distributed optimizer's buckets) and keep the clone
until its file is written.

This module is the layer both key layouts build on (`dist_format` writes and
reads the folders, `megatron_dist` keys a model as Megatron-Core does); it knows
nothing of either.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from mg.core.parallel.row_blocks import row_blocks, row_runs

Pieces = list[tuple[Tensor, tuple[int, ...]]]


@contextlib.contextmanager
def single_process_is_intended() -> Iterator[None]:
    """DCP warns on every save/load without a process group; one process is our intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r"torch\.distributed is (disabled, )?unavailable or uninitialized"
        )
        yield


class GlobalChunks(Tensor):
    """One rank's pieces of a global tensor, each at its global offsets, for DCP.

    A wrapper tensor of the global shape holding no data of its own; DCP asks it for
    its chunks (`__create_chunk_list__`), write items and the tensor of one chunk
    (`__get_tensor_shard__`), which is the piece itself, so reads land in it."""

    @staticmethod
    def __new__(cls, global_shape: Iterable[int], pieces: Pieces):
        first = pieces[0][0]
        return Tensor._make_wrapper_subclass(
            cls, torch.Size(global_shape), dtype=first.dtype, device=first.device
        )

    def __init__(self, global_shape: Iterable[int], pieces: Pieces) -> None:
        self.global_shape = torch.Size(global_shape)
        self.pieces = [(tensor, torch.Size(offset)) for tensor, offset in pieces]

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise NotImplementedError(f"GlobalChunks is a checkpoint index, not for {func}")

    def __repr__(self) -> str:  # the default would print data this wrapper does not have
        return f"GlobalChunks({tuple(self.global_shape)}, {len(self.pieces)} pieces)"

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=o, sizes=t.shape) for t, o in self.pieces]

    def __create_write_items__(self, fqn: str, obj: Any, index: int | None = None) -> list:
        return [
            WriteItem(
                index=MetadataIndex(fqn, offset, i),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offset, sizes=tensor.shape),
                    properties=TensorProperties.create_from_tensor(tensor),
                    size=self.global_shape,
                ),
            )
            for i, (tensor, offset) in enumerate(self.pieces)
        ]

    def __get_tensor_shard__(self, index: MetadataIndex) -> Tensor:
        if index.index is not None and index.index < len(self.pieces):
            tensor, offset = self.pieces[index.index]
            if offset == index.offset:
                return tensor
        for tensor, offset in self.pieces:
            if offset == index.offset:
                return tensor
        raise ValueError(f"{index.fqn}: no piece at offsets {index.offset}")

    def host_copy(self) -> GlobalChunks:
        """The same pieces copied to host memory (what an async save writes from)."""
        return GlobalChunks(
            self.global_shape, [(t.detach().to("cpu", copy=True), o) for t, o in self.pieces]
        )


def own_storage(tensor: Tensor) -> Tensor:
    """`tensor` over a storage of exactly its bytes, sharing its memory.

    Parameters and optimizer state are views into flat buffers (the
    distributed optimizer's buckets). DCP's writer clones a tensor whose
    storage is larger than it, and keeps every clone of a file until the file
    is written: a full copy of the rank's state. A slice of the storage is the
    same memory with no excess, so nothing is cloned; a load writes through it
    into the original. Non-contiguous tensors are left as they are."""
    if isinstance(tensor, LocalShardsWrapper):
        shards = [own_storage(shard) for shard in tensor.local_shards()]
        return LocalShardsWrapper(shards, tensor.local_offsets())
    storage = tensor.untyped_storage()
    if tensor.numel() == 0 or not tensor.is_contiguous() or storage.nbytes() == tensor.nbytes:
        return tensor
    start = tensor.storage_offset() * tensor.element_size()
    piece = storage[start : start + tensor.nbytes]
    with torch.no_grad():
        return torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(
            piece, 0, tensor.shape, tensor.stride()
        )


def _strided_pieces(tensor: DTensor) -> Pieces:
    """A `_StridedShard` DTensor's (a gated MLP's [gate; up] rows) local pieces at their
    global offsets: rank r of n holds chunks r, r+n, … of split_factor·n. Views, so a
    load writes into the parameter itself."""
    (placement,) = tensor.placements
    mesh = tensor.device_mesh
    n, r = mesh.size(), mesh.get_local_rank()
    dim, factor = placement.dim, placement.split_factor
    pieces = tensor.to_local().chunk(factor, dim=dim)
    piece_len = tensor.shape[dim] // (factor * n)
    out = []
    for j, piece in enumerate(pieces):
        offset = [0] * tensor.dim()
        offset[dim] = (j * n + r) * piece_len
        out.append((own_storage(piece), tuple(offset)))
    return out


def dtensor_pieces(tensor: DTensor) -> Pieces:
    """A DTensor's local data as pieces of its global tensor, each at its global offsets."""
    local = tensor._local_tensor
    if isinstance(local, LocalShardsWrapper):  # pieces that already know their offsets
        offsets = local.local_offsets()
        return [
            (own_storage(t), tuple(o)) for t, o in zip(local.local_shards(), offsets, strict=True)
        ]
    if any(isinstance(p, _StridedShard) for p in tensor.placements):
        if tensor.device_mesh.ndim != 1:
            raise NotImplementedError("strided shards are supported on a 1-D mesh only")
        return _strided_pieces(tensor)
    blocks = row_blocks(tensor)
    if blocks is not None:  # a slice of each row block (mg.core.parallel.row_blocks)
        mesh = tensor.device_mesh
        runs = row_runs(blocks, mesh.size(), mesh.get_local_rank())
        rest = (0,) * (tensor.dim() - 1)
        return [(own_storage(local.narrow(0, a, n)), (g, *rest)) for a, n, g in runs]
    _, offsets = compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, tensor.placements
    )
    return [(own_storage(local), tuple(offsets))]


def tensor_pieces(value: Tensor) -> Pieces:
    """A tensor's pieces of its global tensor with their offsets: a plain tensor is whole;
    a DTensor gives its local shard (or a strided shard's chunks) at their offsets. Views
    over exactly their own bytes (`own_storage`), so DCP writes without cloning."""
    if isinstance(value, GlobalChunks):
        return list(value.pieces)
    if isinstance(value, DTensor):
        return dtensor_pieces(value)
    return [(own_storage(value), (0,) * value.dim())]


def dcp_ready(state: Any) -> Any:
    """A copy of a nested state dict in which every tensor is something DCP can chunk,
    over storage of its own size (`own_storage`): DTensors become the `GlobalChunks` of
    their local pieces, so every rank says where its data sits in the global tensor."""
    if isinstance(state, Mapping):
        return {k: dcp_ready(v) for k, v in state.items()}
    if isinstance(state, list):
        return [dcp_ready(v) for v in state]
    if isinstance(state, GlobalChunks):
        return state
    if isinstance(state, DTensor):
        return GlobalChunks(state.shape, dtensor_pieces(state))
    if isinstance(state, Tensor):
        return own_storage(state)
    return state
