"""FSDP2's all-gather and reduce-scatter on gloo, in place (CPU training).

gloo's `all_gather_into_tensor` and `reduce_scatter_tensor` each copy a whole
unit's worth of data on top of what FSDP2 already allocates for them, and are
slower than gloo's own broadcast and all-reduce (4 ranks, a 0.31 GB tensor on
2 cores: all-gather 1.5 s and +0.31 GB against four broadcasts 0.6 s and no
copy; reduce-scatter 1.3 s and +0.31 GB against an all-reduce 0.7 s, in place).
At the largest unit of a small model (the vocab × hidden embedding) that copy is
the peak of a ZeRO-3 step. FSDP2 lets a unit bring its own collectives
(`set_custom_all_gather`, `set_custom_reduce_scatter`); on gloo every unit gets
these:

- `BroadcastAllGather`: each rank's shard broadcast into its place in the output,
  where FSDP2 already copied this rank's own. A unit of one parameter (the
  embedding, an untied output layer) has its all-gather output laid out exactly
  as the parameter (rank-major, dim-0 shards), so the output is the parameter's
  own storage and FSDP2's copy-out copies it onto itself: the whole weight is held
  once, not twice. (That reads FSDP2's parameter record; where it is not there, the
  output is a fresh buffer as before.) The broadcasts run when FSDP2 waits for them,
  before its copy-out: a prefetched unit holds nothing whole until it is needed (on a
  synchronous collective a prefetch overlaps nothing), and the output is freed after
  the copy-out, not kept until the next unit's.
- `AllReduceScatter`: the input summed in place by one all-reduce, and this rank's
  chunk copied out (averaged where FSDP2 asks for an average, which gloo's
  all-reduce lacks); any other reduction goes to gloo's reduce-scatter. The input's
  memory is released as the call returns (synchronous: nothing reads it after),
  where FSDP2 keeps it until the next unit's reduction.

NCCL needs none of this (its collectives write in place), so units on any other
backend keep FSDP2's own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_param_all_gather_inputs


def uses_gloo(group: dist.ProcessGroup) -> bool:
    """Whether `group`'s collectives run on gloo (CPU tensors)."""
    return "gloo" in str(dist.get_backend(group))


class BroadcastAllGather(AllGather):
    """All-gather as one broadcast per rank, into the unit's parameter where it is one."""

    def __init__(self, module: nn.Module) -> None:
        self._module = module

    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        target = _parameter_storage(self._module, size, dtype)
        buffer = torch.empty(0 if target is not None else size, dtype=dtype, device=device)
        if target is None:
            return buffer
        storage = target.untyped_storage()
        if storage.size() != target.numel() * target.itemsize:
            storage.resize_(target.numel() * target.itemsize)
        # the parameter's storage under a tensor of its own: writing it does not bump the
        # version of the parameter, which autograd may have saved (FSDP2's copy-out does
        # not either: the values are the same)
        with torch.no_grad():
            return buffer.set_(storage, 0, (target.numel(),))

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work:
        refill = _shard_refill(self._module, input_tensor)
        return _LazyBroadcasts(output_tensor, input_tensor, group, refill)


Refill = Callable[[torch.Tensor], None]


class _LazyBroadcasts(dist.Work):
    """The all-gather, run when FSDP2 waits for it (before its copy-out). Until then the
    output holds no memory: a prefetch (FSDP2's default one unit ahead in the backward)
    would otherwise hold a whole unit's output, and its parameters, for an overlap that
    a synchronous collective cannot have. This rank's part is copied again from its
    shards at the wait (`refill`; they do not change between a unit's all-gather and its
    use), or, where that cannot be done, kept as a copy meanwhile. Every rank waits in
    the same order (the same program), so the broadcasts match."""

    def __init__(
        self,
        output: torch.Tensor,
        own: torch.Tensor,
        group: dist.ProcessGroup,
        refill: Refill | None = None,
    ):
        super().__init__()
        self._output, self._group, self._refill = output, group, refill
        self._own = own.reshape(-1).clone() if refill is None else None
        self._bytes = output.untyped_storage().nbytes()
        output.untyped_storage().resize_(0)

    def wait(self, timeout: object = None) -> bool:
        if self._output is None:
            return True
        output, group = self._output, self._group
        output.untyped_storage().resize_(self._bytes)
        own = output.view(group.size(), -1)[group.rank()]
        if self._refill is not None:
            self._refill(own)
        else:
            own.copy_(self._own)
        broadcast_all_gather(output, group)
        self._output = self._own = self._refill = None
        return True

    def is_completed(self) -> bool:
        return self._output is None


class AllReduceScatter(ReduceScatter):
    """Reduce-scatter as an in-place all-reduce of the input and a copy of this rank's chunk."""

    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp,
        async_op: bool = False,
    ) -> None:
        average = op == dist.ReduceOp.AVG
        if not (average or op == dist.ReduceOp.SUM):
            dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group)
            return None
        all_reduce_scatter(output_tensor, input_tensor, group)
        if average:
            output_tensor.div_(group.size())
        # done with it: FSDP2 keeps the input alive until the next unit's reduction, for an
        # asynchronous collective still reading it; this one is not, so let it hold nothing
        input_tensor.untyped_storage().resize_(0)
        return None


def broadcast_all_gather(output: torch.Tensor, group: dist.ProcessGroup) -> None:
    """All-gather in place: `output` holds this rank's part at its place (rank-major,
    equal parts); each rank's part is broadcast into the others'."""
    for rank, chunk in enumerate(output.view(group.size(), -1)):
        dist.broadcast(chunk, group=group, group_src=rank)


def all_reduce_scatter(
    output: torch.Tensor, stacked: torch.Tensor, group: dist.ProcessGroup
) -> None:
    """Reduce-scatter (sum) as an all-reduce of `stacked` in place (it is overwritten) and
    a copy of this rank's part into `output`."""
    dist.all_reduce(stacked, op=dist.ReduceOp.SUM, group=group)
    output.copy_(stacked.view(group.size(), -1)[group.rank()].view_as(output))


def use_in_place_collectives(modules: Iterable[nn.Module]) -> None:
    """Give every FSDP unit among `modules` the collectives above where it shards on gloo."""
    for module in modules:
        if not isinstance(module, FSDPModule):
            continue
        groups = _param_groups(module)
        shard_group = getattr(groups[0].mesh_info, "shard_process_group", None) if groups else None
        if len(groups) != 1 or shard_group is None or not uses_gloo(shard_group):
            continue
        module.set_custom_all_gather(BroadcastAllGather(module))
        module.set_custom_reduce_scatter(AllReduceScatter())


def _param_groups(module: nn.Module) -> list:
    if not isinstance(module, FSDPModule):
        return []
    return list(getattr(module._get_fsdp_state(), "_fsdp_param_groups", []))


def _shard_refill(module: nn.Module, own: torch.Tensor) -> Refill | None:
    """A function that copies this rank's all-gather input again from the unit's shards
    (as FSDP2's copy-in does), where FSDP2 made `own` that way: its parameters cast or
    copied as they are, no tensor subclass's own pre-all-gather (e.g. float8), no
    offload; one dtype. None elsewhere."""
    groups = _param_groups(module)
    params = groups[0].fsdp_params if len(groups) == 1 else []
    if not params or any(
        getattr(p, "offload_to_cpu", True)
        or hasattr(p._sharded_local_tensor, "fsdp_pre_all_gather")
        or getattr(p, "padded_sharded_param_size", None) is None
        for p in params
    ):
        return None
    if sum(p.padded_sharded_param_size.numel() for p in params) != own.numel():
        return None
    dtypes = {p.param_dtype or p.orig_dtype for p in params}
    if dtypes != {own.dtype}:
        return None

    def refill(chunk: torch.Tensor) -> None:
        inputs = [t for ts in _get_param_all_gather_inputs(params) for t in ts]
        with torch.no_grad():
            torch._foreach_copy_(torch.split(chunk, [t.numel() for t in inputs]), inputs)

    return refill


def _parameter_storage(
    module: nn.Module, size: Sequence[int], dtype: torch.dtype
) -> torch.Tensor | None:
    """The unit's one parameter's unsharded storage, flat, where the all-gather output of
    `size` and `dtype` has its layout (one parameter, dim-0 shards, gathered before)."""
    groups = _param_groups(module)
    params = groups[0].fsdp_params if len(groups) == 1 else []
    if len(params) != 1:
        return None
    param = params[0]
    outputs = getattr(param, "all_gather_outputs", None)
    placement = getattr(param, "fsdp_placement", None)
    if not outputs or len(outputs) != 1 or placement is None or placement.dim != 0:
        return None
    target = outputs[0]
    if target.dtype != dtype or target.dim() != 1 or target.numel() != _numel(size):
        return None
    return target


def _numel(size: Sequence[int]) -> int:
    total = 1
    for dim in size:
        total *= int(dim)
    return total
