"""Join the per-rank tensor-parallel shards of a `torch`-format checkpoint into whole tensors.

Megatron's partition dims (REFERENCE §4): column-parallel weights — QKV,
MLP-in, the word embedding and the output layer — are split along dim 0, and
so are their biases; row-parallel weights — the attention projection and
MLP-out — along dim 1 (their biases are replicated). Everything else (norms,
position embeddings) is replicated and taken from rank 0. A gated MLP-in
([gate; up]) is split per half: rank r holds [gate_r; up_r].

An MoE layer's experts follow the MLP's rule with expert tensor parallelism equal
to TP (Megatron's default): each routed expert's linear_fc1 (SequentialMLP's
`local_experts.N.linear_fc1`, grouped GEMM's `linear_fc1.weightN`) and the shared
experts' are column-parallel, their linear_fc2 row-parallel; the router and the
shared-expert gate are replicated. With --expert-tensor-parallel-size 1 each TP rank
holds the routed experts whole (`whole_experts`).

A Mamba mixer (megatron-core's MambaMixer) is split by heads and groups: A_log,
D, dt_bias and the gated norm's weight along dim 0, out_proj along dim 1, and
in_proj ([z; x; B; C; dt]) and conv1d ([x; B; C]) take a slice of each block
(`mg.core.parallel.row_blocks`), whose sizes the model config gives.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from mg.core.checkpoint.ep_merge import is_routed_expert
from mg.core.parallel.row_blocks import merge_rows

_DIM0 = (
    "self_attention.linear_qkv.weight",
    "self_attention.linear_qkv.bias",
    "mlp.linear_fc1.weight",
    "mlp.linear_fc1.bias",
    "embedding.word_embeddings.weight",
    "output_layer.weight",
    "self_attention.core_attention.softmax_offset",  # attention sinks: one per head
)
_DIM1 = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
_MAMBA_DIM0 = ("mixer.A_log", "mixer.D", "mixer.dt_bias", "mixer.norm.weight")
_MAMBA_BLOCKS = ("mixer.in_proj.weight", "mixer.conv1d.weight", "mixer.conv1d.bias")
# routed experts (sequential or grouped GEMM) and shared experts: fc1 column-, fc2 row-parallel
_EXPERT_LINEAR = re.compile(
    r"(?:^|\.)mlp\.(?:experts\.(?:local_experts\.\d+\.)?|shared_experts\.)"
    r"linear_fc(?P<fc>[12])\.(?P<kind>weight|bias)\d*$"
)


def partition_dim(name: str) -> int | None:
    """The dim a tensor-parallel shard of `name` is split along; None if replicated."""
    if name.endswith(_DIM0 + _MAMBA_DIM0 + _MAMBA_BLOCKS):
        return 0
    if name.endswith(_DIM1 + ("mixer.out_proj.weight",)):
        return 1
    match = _EXPERT_LINEAR.search(name)
    if match is not None:
        if match["fc"] == "1":
            return 0
        return 1 if match["kind"] == "weight" else None
    return None


def is_gated_fc1(name: str) -> bool:
    """Whether `name` is an MLP-in weight or bias ([gate; up] rows in a gated MLP)."""
    if name.endswith(("mlp.linear_fc1.weight", "mlp.linear_fc1.bias")):
        return True
    match = _EXPERT_LINEAR.search(name)
    return match is not None and match["fc"] == "1"


def mamba_row_blocks(name: str, config: Any) -> tuple[int, ...] | None:
    """The whole row blocks of a Mamba mixer's in_proj ([z; x; B; C; dt]) or conv1d
    ([x; B; C]) from its `MambaConfig`; None for any other tensor."""
    if not name.endswith(_MAMBA_BLOCKS):
        return None
    if config is None or not hasattr(config, "mamba_d_inner"):
        raise ValueError(f"{name}: splitting a Mamba mixer over TP ranks needs its MambaConfig")
    d_inner, bc = config.mamba_d_inner, config.mamba_num_groups * config.mamba_state_dim
    if name.endswith("in_proj.weight"):
        return (d_inner, d_inner, bc, bc, config.mamba_num_heads)
    return (d_inner, bc, bc)


def _local(value: Any) -> Any:
    return value.to_local() if isinstance(value, DTensor) else value


def merge_tensor_parallel(
    shards: Sequence[Mapping[str, Tensor]],
    gated: bool,
    config: Any = None,
    whole_experts: bool = False,
) -> dict[str, Tensor]:
    """Whole tensors from the model state dicts of TP ranks 0..n-1 (in rank order);
    `config` (the model's) is needed for a Mamba mixer's blocks. mg-train's `torch`
    files hold each rank's shard as a DTensor: its local tensor is the shard.
    `whole_experts` (--expert-tensor-parallel-size 1): every rank holds the routed
    experts whole, so they are taken from rank 0."""
    shards = [{k: _local(v) for k, v in shard.items()} for shard in shards]
    merged: dict[str, Tensor] = {}
    for name, first in shards[0].items():
        dim = None if whole_experts and is_routed_expert(name) else partition_dim(name)
        if dim is None or len(shards) == 1:
            merged[name] = first
            continue
        parts = [shard[name] for shard in shards]
        blocks = mamba_row_blocks(name, config)
        if blocks is not None:
            merged[name] = merge_rows(parts, blocks)
        elif gated and is_gated_fc1(name):
            halves = [p.chunk(2, dim=0) for p in parts]
            merged[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
        else:
            merged[name] = torch.cat(parts, dim=dim)
    return merged
