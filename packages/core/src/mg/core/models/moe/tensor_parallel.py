"""An MoE layer under tensor parallelism: experts sharded as Megatron's MLP, router replicated.

Megatron's expert-tensor-parallel = TP layout: each expert's (and the shared
experts') linear_fc1 is column-parallel (a gated one by halves, as the dense
MLP's) and linear_fc2 row-parallel; the router and the shared-expert gate are
replicated. `shard_moe_layer` makes those weights DTensors on the TP mesh and
gives the layer its TP group; the layer then works on the whole sequence:

    x_full = all-gather over TP (sequence parallelism) | x
    every TP rank routes x_full alike, dispatches it over its own EP group and
    runs its slice of every expert: a partial sum of the output
    out = reduce-scatter over TP (sequence parallelism) | all-reduce

so each rank's gradients of everything before the slices (router, shared
gate, input) are partial sums: the replicated weights' local views hand their
gradients on as Partial (all-reduced over TP with the sequence-parallel
norms'), and the balancing losses, the same on every TP rank, have their
gradient divided by TP (`moe_step.begin_step`). A linear_fc1 bias is sharded
with its rows; a linear_fc2 bias, replicated, is added by every TP rank times
1/tp (its gradient is then a partial sum too).

Megatron's expert-tensor-parallel size etp < TP (sequence parallelism only,
as Megatron requires; etp divides TP) is the same with the expert
tensor-parallel group in place of TP for the routed experts: the etp
consecutive TP ranks of an ETP group gather their sequence slices (a
contiguous chunk of the sequence), route that chunk alike, dispatch it over
their EP groups, run their etp-slices of the experts and reduce-scatter the
partial outputs back to each rank's slice. The shared experts stay split over
TP, as the dense MLP: they gather the whole sequence and reduce-scatter their
output themselves. At etp = 1 the gather is nothing: each TP rank routes its
own slice, over the expert-parallel group, which with etp < TP is drawn across
the TP ranks (Megatron's tp_ep group), and the experts are whole.

The router's gradients are partial sums over TP again (each ETP group's chunk,
each rank its slices' part). Its balancing losses count tokens over the whole
TP group (`tp_cp_group`): an ETP group's etp copies of a chunk each count it,
so the counts and the token total are etp times the chunk's, each rank's loss
is 1/etp of its chunk's part, and summed over TP, as the gradients are, the
copies make the chunk's part once; their gradient is not divided by TP.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from mg.core.models.moe.dispatcher import gather_rows, reduce_scatter_rows
from mg.core.models.moe.experts import ExpertMLP, GroupedLinear, GroupedMLP


def _seq_first(x: Tensor) -> Tensor:
    return x.transpose(0, 1).contiguous()  # [b, s, h] -> [s, b, h]: gathers along dim 0


class _CopyToRegion(torch.autograd.Function):
    """Identity; backward: the partial gradients all-reduced (Megatron's copy_to_tp)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromRegion(torch.autograd.Function):
    """Partial sums all-reduced; backward: identity (Megatron's reduce_from_tp)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:  # type: ignore[override]
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad, None


def enter_region(x: Tensor, group: dist.ProcessGroup, sequence_parallel: bool) -> Tensor:
    """The layer's input [b, s(/tp), h] as the whole sequence on every TP rank."""
    if sequence_parallel:
        return gather_rows(_seq_first(x), group).transpose(0, 1)
    return _CopyToRegion.apply(x, group)


def leave_region(x: Tensor, group: dist.ProcessGroup, sequence_parallel: bool) -> Tensor:
    """Every TP rank's partial output summed: its sequence slice, or the whole."""
    if sequence_parallel:
        return reduce_scatter_rows(_seq_first(x), group).transpose(0, 1)
    return _ReduceFromRegion.apply(x, group)


def _shard(module: nn.Module, name: str, mesh: DeviceMesh, placement) -> None:
    param = getattr(module, name)
    dtensor = distribute_tensor(param.detach(), mesh, [placement], src_data_rank=None)
    new = nn.Parameter(dtensor, requires_grad=param.requires_grad)
    for mark, value in vars(param).items():  # expert parallelism's allreduce=False, etc.
        setattr(new, mark, value)
    module.register_parameter(name, new)


def shard_moe_layer(
    layer: nn.Module,
    tp_mesh: DeviceMesh,
    sequence_parallel: bool,
    experts: bool = True,
    expert_mesh: DeviceMesh | None = None,
) -> None:
    """Megatron's TP layout for one `MoELayer` (see the module docstring); in place.

    `experts=False`: expert-tensor-parallel size 1, the routed experts left whole;
    `expert_mesh`: the mesh they are split over when it is not `tp_mesh` (etp consecutive
    ranks of it, 1 < etp < tp)."""
    tp = tp_mesh.size()
    mesh = (expert_mesh or tp_mesh) if experts else None
    etp = 1 if mesh is None else mesh.size()
    if tp % etp:
        raise ValueError(
            f"--expert-tensor-parallel-size ({etp}) must divide --tensor-model-parallel-size ({tp})"
        )
    own_tokens = etp != tp  # each expert tensor-parallel group routes its own chunk
    if own_tokens and not sequence_parallel:
        raise ValueError(
            f"--expert-tensor-parallel-size {etp} under --tensor-model-parallel-size {tp} "
            "needs --sequence-parallel (as in Megatron)"
        )
    gated = layer.config.gated_linear_unit
    column = _StridedShard(0, split_factor=2) if gated else Shard(0)
    for name, _ in list(layer.router.named_parameters(recurse=False)):
        _shard(layer.router, name, tp_mesh, Replicate())
    owners: list[tuple[nn.Module | None, DeviceMesh | None]] = [(layer.shared_experts, tp_mesh)]
    owners.append((layer.experts, mesh))
    for owner, owner_mesh in owners:
        if owner is None or owner_mesh is None:
            continue
        for mlp in (m for m in owner.modules() if isinstance(m, ExpertMLP)):
            _shard(mlp.linear_fc1, "weight", owner_mesh, column)
            _shard(mlp.linear_fc2, "weight", owner_mesh, Shard(1))
            if mlp.linear_fc1.bias is not None:
                _shard(mlp.linear_fc1, "bias", owner_mesh, column)
                _shard(mlp.linear_fc2, "bias", owner_mesh, Replicate())
                mlp.fc2_bias_scale = 1.0 / owner_mesh.size()
            if getattr(mlp, "gate_weight", None) is not None:
                _shard(mlp, "gate_weight", owner_mesh, Replicate())
    if mesh is not None and isinstance(layer.experts, GroupedMLP):
        for linear, placement in (
            (layer.experts.linear_fc1, column),
            (layer.experts.linear_fc2, Shard(1)),
        ):
            assert isinstance(linear, GroupedLinear)
            for i in range(linear.num_gemms):
                _shard(linear, f"weight{i}", mesh, placement)
                if linear.has_bias:
                    bias = column if linear is layer.experts.linear_fc1 else Replicate()
                    _shard(linear, f"bias{i}", mesh, bias)
        layer.experts.linear_fc2.bias_scale = 1.0 / etp
    layer.sequence_parallel = sequence_parallel
    if mesh is not None:  # the ranks that gather their tokens and split the experts
        layer.etp_group = mesh.get_group()
    if own_tokens:  # each rank's tokens: the balancing losses' counts summed over TP
        layer.shared_experts_tp_group = tp_mesh.get_group()
        layer.router.tp_cp_group = tp_mesh.get_group()
        if layer.router.tp_dp_cp_group is None:
            layer.router.tp_dp_cp_group = tp_mesh.get_group()
