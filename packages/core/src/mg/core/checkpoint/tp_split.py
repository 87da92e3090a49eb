"""Cut whole tensors into Megatron's per-rank tensor-parallel shards (the inverse of tp_merge).

Same partition dims as :mod:`.tp_merge`: column-parallel weights (QKV, MLP-in,
word embedding, output layer) and their biases split along dim 0, row-parallel
weights (attention projection, MLP-out) along dim 1, everything else is
replicated. A gated MLP-in ([gate; up]) is split per half, so rank r holds
[gate_r; up_r]; a Mamba mixer's in_proj and conv1d per block (tp_merge). Shards
are contiguous copies: ``torch.save`` of a view would write the whole tensor it
views.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from mg.core.checkpoint.tp_merge import is_gated_fc1, mamba_row_blocks, partition_dim
from mg.core.parallel.row_blocks import split_rows


def split_tensor(
    name: str, tensor: Tensor, tp: int, gated: bool, config: Any = None
) -> list[Tensor]:
    """The ``tp`` shards of one whole tensor, in rank order (replicas share the tensor);
    `config` (the model's) is needed for a Mamba mixer's blocks."""
    dim = partition_dim(name)
    if dim is None or tp == 1:
        return [tensor] * tp
    blocks = mamba_row_blocks(name, config)
    if blocks is not None:
        return split_rows(tensor, blocks, tp)
    halves = gated and is_gated_fc1(name)
    if tensor.shape[dim] % (2 * tp if halves else tp):
        raise ValueError(
            f"{name}: dim {dim} of shape {tuple(tensor.shape)} does not split into {tp} "
            "tensor-parallel shards"
        )
    if halves:
        gate, up = tensor.chunk(2, dim=0)
        return [
            torch.cat([g, u], dim=0)
            for g, u in zip(gate.chunk(tp, dim=0), up.chunk(tp, dim=0), strict=True)
        ]
    return [part.clone(memory_format=torch.contiguous_format) for part in tensor.chunk(tp, dim)]


def split_tensor_parallel(
    weights: Mapping[str, Tensor], tp: int, gated: bool, config: Any = None
) -> list[dict[str, Tensor]]:
    """The model state dicts of TP ranks 0..tp-1 from whole tensors."""
    shards: list[dict[str, Tensor]] = [{} for _ in range(tp)]
    for name, tensor in weights.items():
        parts = split_tensor(name, tensor, tp, gated, config)
        for shard, part in zip(shards, parts, strict=True):
            shard[name] = part
    return shards
