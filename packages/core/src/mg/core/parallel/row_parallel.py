"""Megatron's RowParallelLinear as a DTensor parallel style: reduce, then add the bias.

Every tensor-parallel plan that splits a linear by its input rows uses it: the
transformer layers' linear_proj and linear_fc2 (tensor_parallel) and a Mamba
mixer's out_proj (tensor_parallel_mamba).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import RowwiseParallel

from mg.core.models.float8_training import bias_free_float8_linear
from mg.core.models.subclass import swap_class


class RowParallelLinear(RowwiseParallel):
    """Megatron's RowParallelLinear: reduce the partial products, then add the bias.

    Given `linear(x_shard, W_shard, bias)` with a replicated bias, DTensor's
    sharding propagation cannot add a replicated bias to a partial sum, so it
    all-gathers the input and the weight and runs the whole matmul on every
    rank (two all-gathers per layer per projection, and the full weight in
    memory). Here the linear runs without its bias, the partial output is
    all-reduced (or reduce-scattered with sequence parallelism) and the bias is
    added to the result, as Megatron does; the bias gradient is then a partial
    sum under sequence parallelism, all-reduced by `sync_tensor_parallel_grads`.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if isinstance(module, nn.Linear) and module.bias is not None:
            swap_class(module, _bias_free(type(module)))
        return super()._apply(module, device_mesh)

    @staticmethod
    def _prepare_output_fn(
        output_layouts: object,
        use_local_output: bool,
        mod: nn.Module,
        outputs: DTensor,
        device_mesh: DeviceMesh,
    ) -> Tensor:
        if outputs.placements != output_layouts:
            outputs = outputs.redistribute(placements=output_layouts, async_op=True)
        if isinstance(mod, nn.Linear) and mod.bias is not None:
            outputs = outputs + mod.bias
        return outputs.to_local() if use_local_output else outputs


class BiasAfterReduceLinear(nn.Linear):
    """A row-parallel `nn.Linear` whose forward leaves out the bias: `RowParallelLinear`
    adds it after the partial products are reduced."""

    def forward(self, hidden: Tensor) -> Tensor:
        return F.linear(hidden, self.weight)


def _bias_free(linear: type[nn.Linear]) -> type[nn.Linear]:
    """The subclass of `linear` whose forward leaves the bias out: ours for `nn.Linear`,
    torchao's FP8 linear's twin for it (`mg.core.models.float8_training`)."""
    if linear is nn.Linear:
        return BiasAfterReduceLinear
    twin = bias_free_float8_linear(linear)
    if twin is None:
        raise TypeError(f"a row-parallel {linear.__name__} cannot leave its bias out")
    return twin
