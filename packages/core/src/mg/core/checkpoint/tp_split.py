"""Cut whole tensors into Megatron's per-rank tensor-parallel shards (the inverse of tp_merge).

Same partition dims as :mod:`.tp_merge`: column-parallel weights (QKV, MLP-in,
word embedding, output layer) and their biases split along dim 0, row-parallel
weights (attention projection, MLP-out) along dim 1, everything else is
replicated. A gated MLP-in ([gate; up]) is split per half, so rank r holds
[gate_r; up_r]. Shards are contiguous copies: ``torch.save`` of a view would
write the whole tensor it views.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from mg.core.checkpoint.tp_merge import partition_dim

_GATED = ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias")


def split_tensor(name: str, tensor: Tensor, tp: int, gated: bool) -> list[Tensor]:
    """The ``tp`` shards of one whole tensor, in rank order (replicas share the tensor)."""
    dim = partition_dim(name)
    if dim is None or tp == 1:
        return [tensor] * tp
    if tensor.shape[dim] % (2 * tp if gated and name.endswith(_GATED) else tp):
        raise ValueError(
            f"{name}: dim {dim} of shape {tuple(tensor.shape)} does not split into {tp} "
            "tensor-parallel shards"
        )
    if gated and name.endswith(_GATED):
        gate, up = tensor.chunk(2, dim=0)
        return [
            torch.cat([g, u], dim=0)
            for g, u in zip(gate.chunk(tp, dim=0), up.chunk(tp, dim=0), strict=True)
        ]
    return [part.clone(memory_format=torch.contiguous_format) for part in tensor.chunk(tp, dim)]


def split_tensor_parallel(
    weights: Mapping[str, Tensor], tp: int, gated: bool
) -> list[dict[str, Tensor]]:
    """The model state dicts of TP ranks 0..tp-1 from whole tensors."""
    shards: list[dict[str, Tensor]] = [{} for _ in range(tp)]
    for name, tensor in weights.items():
        for shard, part in zip(shards, split_tensor(name, tensor, tp, gated), strict=True):
            shard[name] = part
    return shards
