"""`--log-params-norm` and `--log-num-zeros-in-grad`: whole-model sums over every layout.

Both are the gradient norm's reduction (`mg.core.parallel.grad_norm.global_sum`)
with another statistic: a tensor-parallel (or FSDP) shard is summed over the ranks
of its mesh, a replicated tensor (a norm weight on every TP rank, any tensor on
every data-parallel replica) counted once; routed experts are summed over the
expert-parallel group, every stage's own tensors over the pipeline group, and the
last stage's copy of a tied embedding is left out, as Megatron's
`calc_params_l2_norm` and `count_zeros_fp32` do.

The parameters are the model's (all of them, frozen ones too, as Megatron's norm),
in their own precision summed in float64 (Megatron reads the fp32 main copies of
bf16 parameters where its optimizer keeps them, a difference within bf16's rounding);
the gradients are those the optimizer stepped with, unscaled and clipped (Megatron
counts the zeros after clipping): the parameters' own, or under the distributed
optimizer each data-parallel rank's shard of the averaged gradient, summed over the
data-parallel group.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from mg.core.parallel.collective_device import collective_device
from mg.core.parallel.distributed_optimizer import DistributedOptimizer
from mg.core.parallel.expert_optimizer import ExpertParallelDistributedOptimizer
from mg.core.parallel.expert_parallel import is_expert_parameter
from mg.core.parallel.grad_norm import LocalStat, global_sum, sharded_dims, squares, zeros
from mg.core.parallel.layout import ParallelLayout
from mg.core.parallel.pipeline_stage import is_shared_copy


@torch.no_grad()
def params_l2_norm(model: nn.Module, optimizer: Any, layout: ParallelLayout) -> float:
    """The L2 norm of all parameters, each counted once (the same on every rank)."""
    finish = getattr(optimizer, "finish_param_sync", None)
    if finish is not None:  # an --overlap-param-gather all-gather still in flight
        finish()
    return math.sqrt(_over_stages(_stage_sums(model.parameters(), squares, layout), layout))


@torch.no_grad()
def num_zeros_in_grads(model: nn.Module, optimizer: Any, layout: ParallelLayout) -> int:
    """The number of zero gradient elements, each element counted once."""
    if isinstance(optimizer, ExpertParallelDistributedOptimizer):
        totals = _shard_sums(optimizer.dense, zeros)
        if optimizer.experts is not None:
            totals += _shard_sums(optimizer.experts, zeros, experts=True)
        if layout.ep_group is not None:  # the experts held by the other EP ranks
            totals[1:] = _all_reduce(totals[1:], layout.ep_group)
    elif isinstance(optimizer, DistributedOptimizer):
        totals = _shard_sums(optimizer, zeros)
    else:
        with_grads = [p for p in model.parameters() if p.grad is not None]
        totals = _stage_sums(with_grads, zeros, layout, use_grad=True)
    return round(_over_stages(totals, layout))


def _stage_sums(
    params: Iterable[nn.Parameter], stat: LocalStat, layout: ParallelLayout, use_grad: bool = False
) -> Tensor:
    """[dense, experts]: `stat` over this stage's parameters (or their gradients), the
    tied copy left out, the experts summed over the expert-parallel group."""
    dense: list[Tensor] = []
    experts: list[Tensor] = []
    for param in params:
        if is_shared_copy(param):
            continue
        apart = layout.experts_apart and is_expert_parameter(param)
        (experts if apart else dense).append(param.grad if use_grad else param)
    totals = torch.tensor([global_sum(dense, stat), global_sum(experts, stat)], dtype=torch.float64)
    if layout.experts_apart and layout.ep_group is not None:
        totals[1:] = _all_reduce(totals[1:], layout.ep_group)
    return totals


def _shard_sums(optimizer: DistributedOptimizer, stat: LocalStat, experts: bool = False) -> Tensor:
    """[dense, experts]: `stat` over the distributed optimizer's averaged gradient shards
    (`experts`: the expert-parallel optimizer's expert part),
    summed over its data-parallel group, the tensor-parallel shards over TP (the
    replicated ones counted once), as the optimizer's own `grad_norm_squares`."""
    # [TP-sharded, replicated]: the same two collectives on every rank, whatever its shard
    shards = [(p, g) for p, g in optimizer.grad_shards() if not is_shared_copy(p)]
    on = shards[0][1].device if shards else torch.device("cpu")
    sums = torch.zeros(2, dtype=torch.float64, device=on)  # one host copy at the end
    for param, grad in shards:
        sums[0 if sharded_dims(param) else 1] += stat(grad)
    sums = sums.cpu()
    if optimizer.dp_size > 1:
        sums = _all_reduce(sums, optimizer.group or dist.group.WORLD)
    meshes = {p.device_mesh for p in optimizer.params if sharded_dims(p)}
    if len(meshes) == 1:  # the tensor-parallel mesh (1-D, as the optimizer requires)
        sums[0:1] = _all_reduce(sums[0:1], next(iter(meshes)).get_group())
    total = float(sums.sum())
    return torch.tensor([0.0, total] if experts else [total, 0.0], dtype=torch.float64)


def _over_stages(totals: Tensor, layout: ParallelLayout) -> float:
    """The sum of every pipeline stage's totals."""
    if layout.pp > 1 and layout.pp_group is not None:
        totals = _all_reduce(totals, layout.pp_group)
    return float(totals.sum())


def _all_reduce(value: Tensor, group: Any) -> Tensor:
    """A sum over `group`, on the device its backend reduces on."""
    on_device = value.to(collective_device(group), copy=True)
    dist.all_reduce(on_device, group=group)
    return on_device.cpu()
