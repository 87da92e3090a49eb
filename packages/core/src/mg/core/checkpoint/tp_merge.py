"""Join the per-rank tensor-parallel shards of a `torch`-format checkpoint into whole tensors.

Megatron's partition dims (REFERENCE §4): column-parallel weights — QKV,
MLP-in, the word embedding and the output layer — are split along dim 0, and
so are their biases; row-parallel weights — the attention projection and
MLP-out — along dim 1 (their biases are replicated). Everything else (norms,
position embeddings) is replicated and taken from rank 0. A gated MLP-in
([gate; up]) is split per half: rank r holds [gate_r; up_r].
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

_DIM0 = (
    "self_attention.linear_qkv.weight",
    "self_attention.linear_qkv.bias",
    "mlp.linear_fc1.weight",
    "mlp.linear_fc1.bias",
    "embedding.word_embeddings.weight",
    "output_layer.weight",
)
_DIM1 = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")


def partition_dim(name: str) -> int | None:
    """The dim a tensor-parallel shard of `name` is split along; None if replicated."""
    if name.endswith(_DIM0):
        return 0
    if name.endswith(_DIM1):
        return 1
    return None


def merge_tensor_parallel(shards: Sequence[Mapping[str, Tensor]], gated: bool) -> dict[str, Tensor]:
    """Whole tensors from the model state dicts of TP ranks 0..n-1 (in rank order)."""
    merged: dict[str, Tensor] = {}
    for name, first in shards[0].items():
        dim = partition_dim(name)
        if dim is None or len(shards) == 1:
            merged[name] = first
            continue
        parts = [shard[name] for shard in shards]
        if gated and name.endswith(("mlp.linear_fc1.weight", "mlp.linear_fc1.bias")):
            halves = [p.chunk(2, dim=0) for p in parts]
            merged[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
        else:
            merged[name] = torch.cat(parts, dim=dim)
    return merged
