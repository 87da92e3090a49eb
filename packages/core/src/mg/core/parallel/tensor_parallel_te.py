"""Tensor parallelism for the TE spec's `LayerNormLinear`: a norm fused into a column linear.

Megatron's TE spec keeps the layer's input norm inside `self_attention.linear_qkv`
and the pre-MLP norm inside `mlp.linear_fc1`. Under tensor parallelism the
linear's weight and bias split by rows like any column-parallel linear (a gated
fc1 per half, [gate_r; up_r]), while `layer_norm_weight`/`layer_norm_bias` stay
whole on every rank, as TE's LayerNormLinear keeps them.

The norm runs where the activations are, as in TE: on this rank's sequence
slice with sequence parallelism, then the normed slices are all-gathered
(backward: reduce-scattered) and the norm's weight gradient is a partial sum,
all-reduced with the other sequence-parallel norms' by
`sync_tensor_parallel_grads`; without sequence parallelism on the whole
replicated sequence, with the input gradient all-reduced after the matmul so
the norm's gradient is whole on every rank (its weights then stay plain
tensors, as the local spec's norms do). The numbers are the local spec's norm
module followed by `ColwiseParallel`.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import _StridedShard

from mg.core.models.subclass import swap_class
from mg.core.models.te_spec import LayerNormLinear


class LayerNormColwiseParallel(ParallelStyle):
    """Column parallelism for a `mg.core.models.te_spec.LayerNormLinear` (see the module doc).

    The module takes its input in the activations' layout ([b, s/tp, h] with
    sequence parallelism, else [b, s, h]; a local tensor or a DTensor) and returns
    this rank's output columns as a local tensor."""

    def __init__(self, sequence_parallel: bool, gated: bool = False) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel
        self.gated = gated

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        rows = _StridedShard(0, split_factor=2) if self.gated else Shard(0)
        placements = {"weight": rows, "bias": rows}
        if self.sequence_parallel:  # the norm's gradient is partial: a DTensor to all-reduce
            placements.update(layer_norm_weight=Replicate(), layer_norm_bias=Replicate())
        for name, placement in placements.items():
            param = getattr(module, name, None)
            if param is None:
                continue
            distributed = distribute_tensor(
                param, device_mesh, [placement], src_data_rank=self.src_data_rank
            )
            module.register_parameter(
                name, nn.Parameter(distributed, requires_grad=param.requires_grad)
            )
        swap_class(
            module,
            SequenceParallelLayerNormColumnLinear
            if self.sequence_parallel
            else LayerNormColumnLinear,
        )
        return module


def _local(hidden: Tensor) -> Tensor:
    return hidden.to_local() if isinstance(hidden, DTensor) else hidden


def _rows_times_local_weight(module: nn.Module, normed: DTensor) -> Tensor:
    """This rank's output columns of a replicated normed input; the input's gradient is
    marked partial (each rank's covers its columns only), so DTensor all-reduces or
    reduce-scatters it on the way back."""
    x = normed.to_local(grad_placements=[Partial()])
    bias = module.bias.to_local() if module.bias is not None else None
    return F.linear(x, module.weight.to_local(), bias)


class LayerNormColumnLinear(LayerNormLinear):
    """Without sequence parallelism: norm the whole (replicated) sequence locally, then
    this rank's output columns."""

    def forward(self, hidden: Tensor) -> Tensor:
        normed = self.normalize(_local(hidden))
        mesh = self.weight.device_mesh
        return _rows_times_local_weight(
            self, DTensor.from_local(normed, mesh, [Replicate()], run_check=False)
        )


class SequenceParallelLayerNormColumnLinear(LayerNormLinear):
    """With sequence parallelism: norm this rank's slice, then gather the normed slices."""

    def forward(self, hidden: Tensor) -> Tensor:
        partial = [Partial()]  # each rank's norm-weight gradient covers its slice only
        weight = self.layer_norm_weight.to_local(grad_placements=partial)
        bias = self.layer_norm_bias
        bias = bias.to_local(grad_placements=partial) if bias is not None else None
        normed = self.normalize(_local(hidden), weight, bias)
        mesh = self.weight.device_mesh
        gathered = DTensor.from_local(normed, mesh, [Shard(1)], run_check=False).redistribute(
            mesh, [Replicate()]
        )
        return _rows_times_local_weight(self, gathered)
