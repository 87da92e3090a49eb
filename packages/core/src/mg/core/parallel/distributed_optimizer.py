"""Megatron's distributed optimizer: optimizer state sharded over data-parallel ranks.

What it does, per step (the ZeRO-1/2 scheme of Megatron-Core's
`DistributedOptimizer` + `DistributedDataParallel` with a contiguous grad buffer):

1. Parameters are laid out back to back in flat per-dtype *buckets* (the
   parameter tensors become views into them), in reverse registration order so
   a bucket's gradients are all ready early in backward. Each bucket is padded
   to a multiple of the data-parallel size d and split into d equal shards;
   rank r owns shard r.
2. Gradients accumulate into a flat fp32 grad buffer per bucket (fp16 for fp16
   parameters) through post-accumulate-grad hooks, then are reduce-scattered:
   rank r receives the sum of shard r over ranks and divides it by d, i.e. the
   averaged gradient of the parameters it owns. With `overlap_grad_reduce` the
   reduce-scatter of a bucket starts asynchronously as soon as its last
   gradient arrives in the last micro-batch's backward.
3. Each rank keeps fp32 main parameters and the inner optimizer's state
   (AdamW's exp_avg/exp_avg_sq, SGD's momentum) for its shard only, and steps
   them. For fp32 parameters the main parameters *are* the parameter shard
   (views, no copy), as in Megatron.
4. The updated shards are all-gathered back into the parameter buffers. With
   `overlap_param_gather` the all-gather runs asynchronously and a forward
   pre-hook waits on a module's buckets just before it is used.

With tensor parallelism the parameters are DTensors: each TP rank's optimizer
shards its *local* shards over the data-parallel group (the local tensors become
views into the buckets). Gradients that are partial sums per TP rank (the
sequence-parallel norms and row-parallel biases) are all-reduced over TP before
the reduce-scatter, as Megatron's finalize_model_grads does; the gradient norm
sums the TP-sharded squares over TP and counts replicated ones once; an inf/NaN
on any TP rank skips the step on all of them. The state of a DTensor parameter
is returned as a DTensor of the same layout, as torch's optimizers keep it.

With pipeline parallelism each stage's optimizer holds that stage's parameters
(all its model chunks). A tied embedding held by the first and the last stage
gets a bucket of its own, so both copies are sharded alike over the data-
parallel ranks and the embedding group can sum the averaged shards after the
reduce-scatter (Megatron's DDP does the same). The gradient norm and the
inf/NaN check are reduced over the pipeline group, the tied copy counted once.

Memory per parameter, d data-parallel ranks (REFERENCE §7, Megatron's
distributed-optimizer table; the state is counted by `memory_bytes`):

    params / grads      regular   distributed
    fp16 / fp16         20        4 + 16/d    (main params 4, main grads 4, Adam 8)
    bf16 / fp32         18        6 + 12/d    (main params 4, Adam 8)
    fp32 / fp32         16        8 + 8/d     (Adam 8)

Every update is elementwise, so the sharded step equals the unsharded one up to
the order of the floating-point sums in the reduction.

Checkpoints, two ways, neither depending on d, both loadable into a plain torch
optimizer too:

- `state_dict()` gathers the full per-parameter state in `torch.optim.AdamW`'s
  (or SGD's) own format on every data-parallel rank and `load_state_dict()`
  slices it: the `torch` format's per-mp_rank files, as Megatron gathers them.
- `sharded_state()` gives each rank's own fragments only, as views of its flat
  state described in the parameters' global coordinates (`flat_shards`: a flat
  range of a tensor-parallel shard is at most a few boxes of the global
  tensor), and `sharded_state_to_load()` / `load_sharded_state()` read back just
  this rank's regions from whatever layout wrote them: the `torch_dist` format,
  with no full-size copy of any state tensor on any rank.

And Megatron's own `torch`-format pair: `param_groups_state()` (options and step,
in `model_optim_rng.pt`) and `parameter_state_dp_zero()` (the stage's state
gathered on data-parallel rank 0 in the flat layout of Megatron's grad buffers,
`distrib_optim.pt`), loaded by `load_param_groups_state()` and
`load_parameter_state()`, each rank copying only its own fragments.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from mg.core.parallel.dtensor_layout import shard_like
from mg.core.parallel.flat_shards import axis_map_of, checkpoint_tensor, global_pieces
from mg.core.parallel.megatron_buffers import FlatBuffer, megatron_buffers, saved_buffer
from mg.core.parallel.pipeline import is_shared_copy

# State tensors the inner optimizer keeps per parameter (sharded); "step" is replicated.
_SHARDED_STATE: dict[type, tuple[str, ...]] = {
    torch.optim.AdamW: ("exp_avg", "exp_avg_sq"),
    torch.optim.Adam: ("exp_avg", "exp_avg_sq"),
    torch.optim.SGD: ("momentum_buffer",),
}
_MAIN_PARAM_KEY = "main_param"  # extra state entry for non-fp32 parameters


def default_bucket_size(dp_size: int) -> int:
    """Megatron's default `--ddp-bucket-size`: max(40M, 1M·d) elements."""
    return max(40_000_000, 1_000_000 * dp_size)


@dataclass
class _Bucket:
    """One flat run of same-dtype parameters and their gradient buffer."""

    params: list[nn.Parameter]
    offsets: list[int]  # start of each parameter in the bucket
    param_data: Tensor  # padded to a multiple of d; parameters are views into it
    grad_data: Tensor
    shard_size: int
    shard_start: int
    main_param_shard: Tensor  # fp32: the param shard itself, else an fp32 copy
    main_grad_shard: Tensor | None = None  # fp32 averaged gradient of the shard
    grad_handle: Any = None
    gather_handle: Any = None
    ready: set[int] = field(default_factory=set)
    # grad_reduce_dtype: the gradients as sent and this rank's reduced shard, until waited
    reduce_send: Tensor | None = None
    reduce_shard: Tensor | None = None

    @property
    def param_shard(self) -> Tensor:
        return self.param_data[self.shard_start : self.shard_start + self.shard_size]

    @property
    def grad_shard(self) -> Tensor:
        return self.grad_data[self.shard_start : self.shard_start + self.shard_size]


@dataclass
class _Fragment:
    """The part of one parameter that lies in this rank's shard of its bucket."""

    index: int  # the parameter's position in the state dict
    param: nn.Parameter
    bucket: _Bucket
    param_start: int  # first element within param.view(-1)
    shard_offset: int  # first element within the bucket's shard
    numel: int
    main: Tensor  # fp32 view into bucket.main_param_shard, stepped by the inner optimizer


class DistributedOptimizer:
    """Wraps a torch optimizer so that each data-parallel rank steps only its shard.

    `param_groups` are torch-style groups (dicts with "params" and per-group
    options such as weight_decay); `make_optimizer(groups)` builds the inner
    torch optimizer (AdamW, Adam or SGD) over the groups it is given. The
    wrapper is used like the trainer's optimizer, in this order per step:
    `zero_grad()`, backward (inside `no_sync()` for all but the last
    micro-batch), `finish_grad_sync()`, `unscale_and_check(scale)`,
    `clip_grad_norm(max_norm)`, `step()`. `param_groups` is the inner
    optimizer's, so an LR scheduler drives it as usual.
    """

    def __init__(
        self,
        param_groups: list[dict[str, Any]],
        make_optimizer: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
        *,
        dp_group: dist.ProcessGroup | None = None,
        bucket_size: int | None = None,
        overlap_grad_reduce: bool = False,
        overlap_param_gather: bool = False,
        model: nn.Module | None = None,
        pipeline_group: dist.ProcessGroup | None = None,
        tied_weight: Tensor | None = None,
        tied_group: dist.ProcessGroup | None = None,
        grad_reduce_dtype: torch.dtype | None = None,
        grad_divisor: int | None = None,
    ) -> None:
        self.group = dp_group
        # Megatron's --grad-reduce-in-bf16: reduce-scatter in this dtype (pre-divided by d)
        self._reduce_dtype = grad_reduce_dtype
        self._pipeline_group = pipeline_group
        self._tied = (tied_weight, tied_group) if tied_weight is not None and tied_group else None
        initialized = dist.is_available() and dist.is_initialized()
        self.dp_size = dist.get_world_size(dp_group) if initialized else 1
        self.dp_rank = dist.get_rank(dp_group) if initialized else 0
        # what the summed gradients are divided by: the group's size, or for expert-parallel
        # experts (sharded over the expert-data-parallel group) the data-parallel size
        # (Megatron's expert_gradient_scaling_factor)
        self._divisor = grad_divisor or self.dp_size
        self.overlap_grad_reduce = overlap_grad_reduce
        self._requested_bucket_size = bucket_size
        self.overlap_param_gather = overlap_param_gather
        if overlap_param_gather and model is None:
            raise ValueError("overlap_param_gather needs the model (its forward pre-hooks wait)")
        self._group_options = [{k: v for k, v in g.items() if k != "params"} for g in param_groups]
        self._params: list[nn.Parameter] = [p for g in param_groups for p in g["params"]]
        self._group_of = [gi for gi, g in enumerate(param_groups) for _ in g["params"]]
        if len({id(p) for p in self._params}) != len(self._params):
            raise ValueError("a parameter appears twice in the optimizer's parameter groups")
        self._tp_group = _tensor_parallel_group(self._params)
        self._partial_grads: set[int] = set()  # params whose grads are TP partial sums
        order = _layout_order(self._params, model)
        self._buckets = self._build_buckets(order, bucket_size or default_bucket_size(self.dp_size))
        self._fragments = self._build_fragments()
        inner_groups = [{**opts, "params": []} for opts in self._group_options]
        for frag in self._fragments:
            inner_groups[self._group_of[frag.index]]["params"].append(frag.main)
        self.optimizer = make_optimizer(inner_groups)
        self._state_keys = self._sharded_state_keys()
        self._steps = 0
        self._meshes: dict[str, DeviceMesh] = {}  # for sharded_state's chunk wrappers
        self._sync_enabled = True
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_hook) for p in order]
        if overlap_param_gather:
            self._hooks += _register_param_wait_hooks(model, self._bucket_of, self._wait_gather)

    # --- layout -------------------------------------------------------------------------------

    def _build_buckets(self, order: list[nn.Parameter], bucket_size: int) -> list[_Bucket]:
        runs: list[list[nn.Parameter]] = []
        by_dtype: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
        for p in order:  # parameters of one dtype and device share buckets
            if self._tied is not None and p is self._tied[0]:
                runs.append([p])  # sharded alike on every stage that holds a copy
                continue
            run = by_dtype.setdefault((p.dtype, p.device), [])
            if run and sum(_local(q).numel() for q in run) + _local(p).numel() > bucket_size:
                runs.append(run)
                run = by_dtype[(p.dtype, p.device)] = []
            run.append(p)
        runs.extend(run for run in by_dtype.values() if run)
        self._bucket_of: dict[int, _Bucket] = {}
        self._grad_view: dict[int, Tensor] = {}
        return [self._make_bucket(run) for run in runs]

    def _make_bucket(self, params: list[nn.Parameter]) -> _Bucket:
        d = self.dp_size
        numel = sum(_local(p).numel() for p in params)
        shard_size = math.ceil(numel / d)
        dtype, device = params[0].dtype, params[0].device
        grad_dtype = torch.float16 if dtype == torch.float16 else torch.float32
        param_data = torch.zeros(shard_size * d, dtype=dtype, device=device)
        grad_data = torch.zeros(shard_size * d, dtype=grad_dtype, device=device)
        offsets, offset = [], 0
        for p in params:
            local = _local(p)
            view = param_data[offset : offset + local.numel()]
            view.copy_(local.detach().reshape(-1))
            _use_storage_of(p, view)
            self._grad_view[id(p)] = grad_data[offset : offset + local.numel()]
            offsets.append(offset)
            offset += local.numel()
        start = self.dp_rank * shard_size
        shard = param_data[start : start + shard_size]
        main = shard if dtype == torch.float32 else shard.float()
        bucket = _Bucket(params, offsets, param_data, grad_data, shard_size, start, main)
        if grad_dtype == torch.float32:
            bucket.main_grad_shard = bucket.grad_shard
        for p in params:
            self._bucket_of[id(p)] = bucket
        return bucket

    def _build_fragments(self) -> list[_Fragment]:
        index_of = {id(p): i for i, p in enumerate(self._params)}
        fragments = []
        for bucket in self._buckets:
            lo, hi = bucket.shard_start, bucket.shard_start + bucket.shard_size
            for p, offset in zip(bucket.params, bucket.offsets, strict=True):
                start, end = max(lo, offset), min(hi, offset + _local(p).numel())
                if start >= end:
                    continue
                main = bucket.main_param_shard[start - lo : end - lo]
                fragments.append(
                    _Fragment(
                        index_of[id(p)], p, bucket, start - offset, start - lo, end - start, main
                    )
                )
                if bucket.main_grad_shard is not None:
                    main.grad = bucket.main_grad_shard[start - lo : end - lo]
        return sorted(fragments, key=lambda f: (f.index, f.param_start))

    def _sharded_state_keys(self) -> tuple[str, ...]:
        kind = type(self.optimizer)
        if kind not in _SHARDED_STATE:
            raise TypeError(
                f"the distributed optimizer wraps AdamW, Adam or SGD, not {kind.__name__}"
            )
        groups = self.optimizer.param_groups
        if any(g.get("amsgrad") for g in groups):
            raise ValueError("the distributed optimizer does not support amsgrad")
        if kind is torch.optim.SGD and all(g.get("momentum", 0) == 0 for g in groups):
            return ()
        return _SHARDED_STATE[kind]

    # --- gradients ----------------------------------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's groups (one per input group): the LR scheduler sets `lr` here."""
        return self.optimizer.param_groups

    @property
    def params(self) -> list[nn.Parameter]:
        """The model's parameters in `state_dict()`'s index order, so a checkpoint can key
        the state by parameter name (torch_dist)."""
        return list(self._params)

    def group_members(self) -> list[list[int]]:
        """Per parameter group, its parameters' indices in `state_dict()`'s order."""
        return [
            [i for i, g in enumerate(self._group_of) if g == gi]
            for gi in range(len(self._group_options))
        ]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without starting their reduction (not the last micro-batch)."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    @torch.no_grad()
    def _grad_hook(self, param: Tensor) -> None:
        grad = param.grad
        if isinstance(grad, DTensor):
            if grad.placements == param.placements:
                grad = grad.to_local()
            elif _is_partial_of_replicated(grad, param):
                # a sequence-parallel norm or bias: summed over TP before the reduce-scatter
                self._partial_grads.add(id(param))
                grad = grad.to_local()
            else:
                grad = grad.redistribute(param.device_mesh, param.placements).to_local()
        self._grad_view[id(param)].add_(grad.reshape(-1))
        param.grad = None
        if self.overlap_grad_reduce and self._sync_enabled:
            bucket = self._bucket_of[id(param)]
            bucket.ready.add(id(param))
            if len(bucket.ready) == len(bucket.params) and bucket.grad_handle is None:
                self._start_reduce_scatter(bucket, async_op=True)

    def _sum_partial_grads(self, bucket: _Bucket) -> None:
        """All-reduce over TP the gradients that are partial sums per TP rank (Megatron
        all-reduces sequence-parallel gradients in finalize_model_grads), in one call."""
        views = [self._grad_view[id(p)] for p in bucket.params if id(p) in self._partial_grads]
        if not views:
            return
        flat = torch.cat(views)
        dist.all_reduce(flat, group=self._tp_group)
        offset = 0
        for view in views:
            view.copy_(flat[offset : offset + view.numel()])
            offset += view.numel()

    def _start_reduce_scatter(self, bucket: _Bucket, async_op: bool) -> None:
        self._sum_partial_grads(bucket)
        if self.dp_size == 1:
            bucket.grad_handle = _Done()
            return
        send, shard = bucket.grad_data, bucket.grad_shard
        if self._reduce_dtype is not None and send.dtype != self._reduce_dtype:
            # as Megatron's DDP: scale by 1/d first, then sum in the reduce dtype
            send = (send / self._divisor).to(self._reduce_dtype)
            shard = torch.empty(bucket.shard_size, dtype=send.dtype, device=send.device)
            bucket.reduce_send, bucket.reduce_shard = send, shard
        bucket.grad_handle = (
            dist.reduce_scatter_tensor(shard, send, group=self.group, async_op=async_op) or _Done()
        )

    def finish_grad_sync(self) -> None:
        """Finish every bucket's reduce-scatter: this rank's shard then holds the averaged
        gradient (fp32) in `main.grad` of its fragments."""
        for bucket in self._buckets:
            if bucket.grad_handle is None:
                self._start_reduce_scatter(bucket, async_op=False)
            bucket.grad_handle.wait()
            bucket.grad_handle = None
            bucket.ready.clear()
            if bucket.reduce_shard is not None:  # reduced in grad_reduce_dtype, pre-divided
                bucket.grad_shard.copy_(bucket.reduce_shard)
                bucket.reduce_send = bucket.reduce_shard = None
            elif self._divisor != 1:
                bucket.grad_shard.div_(self._divisor)
            if bucket.grad_data.dtype != torch.float32:  # fp16 grads: fp32 main grads
                bucket.main_grad_shard = bucket.grad_shard.float()
        if any(b.grad_data.dtype != torch.float32 for b in self._buckets):
            for frag in self._fragments:
                lo = frag.shard_offset
                frag.main.grad = frag.bucket.main_grad_shard[lo : lo + frag.numel]
        if self._tied is not None:  # the tied copies' averaged shards, summed over stages
            weight, group = self._tied
            dist.all_reduce(self._bucket_of[id(weight)].main_grad_shard, group=group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the grad buffers (they stay allocated: the parameters' hooks add into them)."""
        for bucket in self._buckets:
            bucket.grad_data.zero_()
        for p in self._params:
            p.grad = None

    def _all_reduce(self, value: Tensor, op: dist.ReduceOp) -> Tensor:
        if self.dp_size > 1:
            dist.all_reduce(value, op=op, group=self.group)
        return value

    def unscale_and_check(self, scale: float) -> bool:
        """Divide the shard's gradients by the loss scale; True if any rank found inf/NaN."""
        found = torch.zeros((), dtype=torch.float32, device=self._buckets[0].grad_data.device)
        for bucket in self._buckets:
            if scale != 1.0:
                bucket.main_grad_shard.mul_(1.0 / scale)
            found = torch.maximum(found, (~torch.isfinite(bucket.main_grad_shard)).any().float())
        found = self._all_reduce(found, dist.ReduceOp.MAX)
        for group in (self._tp_group, self._pipeline_group):  # every rank skips alike
            if group is not None:
                dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
        return bool(found > 0)

    def clip_grad_norm(self, max_norm: float) -> float:
        """Global L2 norm of the averaged gradient (squared shard norms all-reduced), and
        `torch.nn.utils.clip_grad_norm_`'s scaling by max_norm / (norm + 1e-6) if > 0."""
        norm = float(self.grad_norm_squares().sum().sqrt())
        if not math.isfinite(norm):
            return float("nan")
        if max_norm > 0:
            self.scale_grads(min(max_norm / (norm + 1e-6), 1.0))
        return norm

    def grad_norm_squares(self) -> Tensor:
        """The squared norms [TP-sharded, replicated] of the averaged gradient, summed over
        the data-, tensor- and pipeline-parallel ranks (a norm over several optimizers adds
        these before the root)."""
        # [TP-sharded parameters' squares, replicated ones'] (the latter are equal on every
        # TP rank, so counted once; the former are summed over TP, as Megatron's norm is)
        squares = torch.zeros(2, dtype=torch.float32, device=self._buckets[0].grad_data.device)
        for frag in self._fragments:
            if is_shared_copy(frag.param):  # the first stage counts the tied weight
                continue
            lo = frag.shard_offset
            grad = frag.bucket.main_grad_shard[lo : lo + frag.numel]
            squares[0 if _is_tp_sharded(frag.param) else 1] += torch.linalg.vector_norm(grad) ** 2
        squares = self._all_reduce(squares, dist.ReduceOp.SUM)
        if self._tp_group is not None:
            dist.all_reduce(squares[0:1], group=self._tp_group)
        if self._pipeline_group is not None:  # each stage's own parameters
            dist.all_reduce(squares, group=self._pipeline_group)
        return squares

    def grad_shards(self) -> list[tuple[nn.Parameter, Tensor]]:
        """(parameter, its part of this rank's averaged gradient shard) per fragment."""
        return [
            (f.param, f.bucket.main_grad_shard[f.shard_offset : f.shard_offset + f.numel])
            for f in self._fragments
        ]

    def scale_grads(self, coefficient: float) -> None:
        """Multiply the shard's gradients (clipping), if the coefficient is below 1."""
        if coefficient < 1.0:
            for bucket in self._buckets:
                bucket.main_grad_shard.mul_(coefficient)

    # --- step and parameters ------------------------------------------------------------------

    def step(self) -> None:
        """Step the shard, copy it into the parameters and all-gather the parameters."""
        self.finish_param_sync()  # an in-flight gather still reads the shards
        self.optimizer.step()
        self._steps += 1
        for bucket in self._buckets:
            if bucket.main_param_shard.data_ptr() != bucket.param_shard.data_ptr():
                bucket.param_shard.copy_(bucket.main_param_shard)
            if self.dp_size > 1:
                bucket.gather_handle = dist.all_gather_into_tensor(
                    bucket.param_data,
                    bucket.param_shard,
                    group=self.group,
                    async_op=self.overlap_param_gather,
                )
        if not self.overlap_param_gather:
            for bucket in self._buckets:
                bucket.gather_handle = None

    def _wait_gather(self, buckets: list[_Bucket]) -> None:
        for bucket in buckets:
            if bucket.gather_handle is not None:
                bucket.gather_handle.wait()
                bucket.gather_handle = None

    def finish_param_sync(self) -> None:
        """Wait for all parameter all-gathers (before reading parameters outside a forward)."""
        self._wait_gather(self._buckets)

    def reload_model_params(self) -> None:
        """Refresh the fp32 main parameters from the (low-precision) parameters, after the
        model's weights were loaded from elsewhere; a no-op for fp32 parameters."""
        self.finish_param_sync()
        for bucket in self._buckets:
            if bucket.main_param_shard.data_ptr() != bucket.param_shard.data_ptr():
                bucket.main_param_shard.copy_(bucket.param_shard)

    # --- state dict ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The full, unsharded state in the inner torch optimizer's own format.

        Collective: every rank of the data-parallel group must call it; each gets
        the whole state (it is gathered per bucket)."""
        self.finish_param_sync()
        groups = self._groups_with_members()
        state: dict[int, dict[str, Any]] = {}
        if self._steps == 0:
            return {"state": state, "param_groups": groups}
        keys = list(self._state_keys)
        if any(b.param_data.dtype != torch.float32 for b in self._buckets):
            keys.append(_MAIN_PARAM_KEY)
        index_of = {id(p): i for i, p in enumerate(self._params)}
        stepped = self._stepped()
        for i in range(len(self._params)):
            state[i] = {"step": torch.tensor(float(self._steps))} if stepped else {}
        for key in keys:
            for bucket in self._buckets:
                gathered = self._gather_bucket_state(bucket, key)
                for p, offset in zip(bucket.params, bucket.offsets, strict=True):
                    local = _local(p)
                    piece = gathered[offset : offset + local.numel()].view(local.shape).clone()
                    state[index_of[id(p)]][key] = shard_like(piece, p)
        return {"state": state, "param_groups": groups}

    def _groups_with_members(self) -> list[dict[str, Any]]:
        """The inner groups' options, each with its members' indices as "params"."""
        return [
            {**{k: v for k, v in inner.items() if k != "params"}, "params": members}
            for inner, members in zip(
                self.optimizer.param_groups, self.group_members(), strict=True
            )
        ]

    def _gather_bucket_state(self, bucket: _Bucket, key: str) -> Tensor:
        if key == _MAIN_PARAM_KEY:
            shard = bucket.main_param_shard.float()
        else:
            shard = torch.zeros(
                bucket.shard_size, dtype=torch.float32, device=bucket.grad_data.device
            )
            for frag in self._fragments:
                if frag.bucket is bucket:
                    value = self.optimizer.state[frag.main][key]
                    shard[frag.shard_offset : frag.shard_offset + frag.numel] = value
        if self.dp_size == 1:
            return shard
        full = torch.empty(bucket.shard_size * self.dp_size, dtype=shard.dtype, device=shard.device)
        dist.all_gather_into_tensor(full, shard, group=self.group)
        return full

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full state (from `state_dict()` at any d, or from the plain torch optimizer)."""
        groups = self._load_group_options(state_dict.get("param_groups"))
        # Saved indices follow the saved group order; map them onto ours position by position.
        order = [i for g in groups for i in g["params"]]
        saved_state = state_dict.get("state", {})
        self.optimizer.state.clear()
        self._steps = 0
        for frag in self._fragments:
            entry = saved_state.get(order[frag.index])
            if entry is None:
                continue
            new: dict[str, Any] = {}
            if "step" in entry:
                step = torch.as_tensor(entry["step"], dtype=torch.float32)
                new["step"] = step.to(self._step_on(frag)).clone()
                self._steps = int(new["step"])
            for key in self._state_keys:
                value = entry.get(key)
                if isinstance(value, DTensor):
                    value = value.redistribute(frag.param.device_mesh, frag.param.placements)
                    value = value.to_local()
                if not isinstance(value, Tensor) or value.numel() != _local(frag.param).numel():
                    raise ValueError(
                        f"optimizer state {key!r} of parameter {frag.index} is missing or not "
                        f"of the model's shape {tuple(frag.param.shape)}; was it saved for a "
                        "different model or optimizer?"
                    )
                new[key] = self._slice(value, frag)
            if _MAIN_PARAM_KEY in entry:
                main = entry[_MAIN_PARAM_KEY]
                if isinstance(main, DTensor):
                    main = main.redistribute(frag.param.device_mesh, frag.param.placements)
                    main = main.to_local()
                frag.main.copy_(self._slice(main, frag))
            self.optimizer.state[frag.main] = new
        self._steps = int(self._all_reduce(torch.tensor(float(self._steps)), dist.ReduceOp.MAX))
        if not any(_MAIN_PARAM_KEY in (e or {}) for e in saved_state.values()):
            self.reload_model_params()

    @staticmethod
    def _slice(value: Tensor, frag: _Fragment) -> Tensor:
        flat = value.reshape(-1)[frag.param_start : frag.param_start + frag.numel]
        return flat.to(device=frag.main.device, dtype=torch.float32).clone()

    def _load_group_options(self, groups: Any) -> list[dict[str, Any]]:
        """Check the saved groups against ours and take their options (lr, betas, …)."""
        if not isinstance(groups, list) or len(groups) != len(self._group_options):
            raise ValueError(
                f"optimizer state has {len(groups) if isinstance(groups, list) else 'no'} "
                f"parameter groups, this optimizer has {len(self._group_options)}; was it saved "
                "for a different model or optimizer?"
            )
        for gi, (saved, inner) in enumerate(zip(groups, self.optimizer.param_groups, strict=True)):
            expected = sum(1 for g in self._group_of if g == gi)
            if len(saved["params"]) != expected:
                raise ValueError(
                    f"optimizer state group {gi} has {len(saved['params'])} parameters, "
                    f"the model has {expected}; was it saved for a different model?"
                )
            inner.update({k: v for k, v in saved.items() if k != "params"})
        return groups

    # --- sharded state (torch_dist) -----------------------------------------------------------

    def sharded_state(self) -> dict[str, Any]:
        """This rank's own part of the state in global coordinates, without gathering.

        `state_dict()`'s structure (groups with member indices; per parameter
        index its "step" and state tensors), but each tensor holds only the
        fragment this rank steps: views of the optimizer's own flat state that
        `flat_shards` describes as chunks of the parameter's global (tensor-
        parallel unsharded) tensor. Over the data- and tensor-parallel ranks the
        fragments tile each tensor once, so DCP stores the same global tensors
        `state_dict()` would, loadable into any layout and by the plain optimizer.
        Left out: parameters this rank owns nothing of, and the last pipeline
        stage's copy of a tied embedding (the first stage writes the equal state).
        "main_param" (the fp32 master weights) is written for non-fp32 parameters.
        Not collective; nothing of full size is made."""
        self.finish_param_sync()
        state: dict[int, dict[str, Any]] = {}
        if self._steps == 0:
            return {"state": state, "param_groups": self._groups_with_members()}
        for frag in self._fragments:
            if is_shared_copy(frag.param):
                continue
            inner = self.optimizer.state.get(frag.main, {})
            entry = self._step_entry()
            for key in self._state_keys:
                if key in inner:
                    entry[key] = self._checkpoint_view(frag, inner[key])
            if _has_main_copy(frag.bucket):
                entry[_MAIN_PARAM_KEY] = self._checkpoint_view(frag, frag.main)
            state[frag.index] = entry
        return {"state": state, "param_groups": self._groups_with_members()}

    def sharded_state_to_load(self, stored: Callable[[int, str], bool]) -> dict[str, Any]:
        """Where a load puts this rank's part of the state: `sharded_state()`'s structure
        over freshly allocated shard-sized state, for DCP to fill from whatever wrote
        the checkpoint (this optimizer at another layout, or the plain one).

        `stored(index, key)` says whether the checkpoint holds that entry of a
        parameter; absent ones are not asked for. The state tensors are installed
        in the inner optimizer at once; finish with `load_sharded_state`."""
        self.finish_param_sync()
        self.optimizer.state.clear()
        state: dict[int, dict[str, Any]] = {}
        for frag in self._fragments:
            entry: dict[str, Any] = {}
            keys = [key for key in self._state_keys if stored(frag.index, key)]
            if keys:
                if len(keys) != len(self._state_keys) or not self._has_step(frag, stored):
                    raise ValueError(
                        f"the checkpoint has {keys} of parameter {frag.index}'s optimizer "
                        f"state, the optimizer needs {list(self._state_keys)} and a step "
                        "count; was it saved for a different optimizer?"
                    )
                inner = {key: torch.zeros_like(frag.main) for key in keys}
                self.optimizer.state[frag.main] = inner
                entry = {**self._step_entry(), **inner}
                for key in keys:
                    entry[key] = self._checkpoint_view(frag, inner[key])
            if _has_main_copy(frag.bucket) and stored(frag.index, _MAIN_PARAM_KEY):
                entry[_MAIN_PARAM_KEY] = self._checkpoint_view(frag, frag.main)
            if entry:
                state[frag.index] = entry
        return {"state": state, "param_groups": self._groups_with_members()}

    def load_sharded_state(self, state_dict: dict[str, Any]) -> None:
        """Finish a load into `sharded_state_to_load()`'s tensors once DCP has filled
        them: take the groups' options (any member lists of the right lengths) and the
        step count, and refresh main parameters the checkpoint did not hold from the
        loaded weights. Collective over the data-parallel group (the step count)."""
        self._load_group_options(state_dict.get("param_groups"))
        loaded = state_dict.get("state", {})
        steps = 0
        for frag in self._fragments:
            entry = loaded.get(frag.index, {})
            inner = self.optimizer.state.get(frag.main)
            if inner is not None:
                step = float(entry["step"]) if "step" in entry else 1.0  # SGD: stepped
                steps = max(steps, int(step))
                if "step" in entry:
                    inner["step"] = torch.tensor(
                        step, dtype=torch.float32, device=self._step_on(frag)
                    )
            if _has_main_copy(frag.bucket) and _MAIN_PARAM_KEY not in entry:
                lo = frag.shard_offset
                frag.main.copy_(frag.bucket.param_shard[lo : lo + frag.numel])
        self._steps = int(self._all_reduce(torch.tensor(float(steps)), dist.ReduceOp.MAX))

    # --- Megatron's torch format: param groups in model_optim_rng.pt, state in distrib_optim.pt

    def megatron_buffers(self, chunks: list[nn.Module]) -> list[FlatBuffer]:
        """The grad buffers Megatron-Core's DDP builds for these chunks with this run's
        settings: one bucket each unless gradients are reduced during backward, then
        `--ddp-bucket-size` or Megatron's default, max(40M, 1M x data-parallel size)."""
        bucket_size = None
        if self.overlap_grad_reduce:
            bucket_size = self._requested_bucket_size or max(40_000_000, 1_000_000 * self.dp_size)
        tied = self._tied[0] if self._tied is not None else None
        mine = {id(p) for p in self._params}
        return megatron_buffers(
            chunks,
            bucket_size=bucket_size,
            shared_embedding=lambda p: p is tied,
            include=lambda p: id(p) in mine,
        )

    def root_position(self, position: tuple[int, ...]) -> tuple[int, ...]:
        """`position` (this rank's indices, e.g. its tp and ep rank) as data-parallel rank 0
        has them: whose `distrib_optim.pt` holds this group's state. Collective over the
        data-parallel group."""
        if self.dp_size == 1:
            return position
        device = self._buckets[0].main_param_shard.device if self._buckets else "cpu"
        values = torch.tensor(position, dtype=torch.int64, device=device)
        dist.broadcast(values, self._root_rank(), group=self.group)
        return tuple(int(v) for v in values.tolist())

    def param_groups_state(self) -> dict[str, Any]:
        """What Megatron's `DistributedOptimizer.state_dict()` keeps in `model_optim_rng.pt`:
        the groups' options and step count, no per-parameter state."""
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "step": float(self._steps)}
            for g in self.param_groups
        ]
        return {"optimizer": {"param_groups": groups}}

    def load_param_groups_state(self, state: dict[str, Any]) -> int:
        """Take the groups' options from `param_groups_state()`'s dict; returns the step."""
        groups = (state.get("optimizer") or {}).get("param_groups")
        if not isinstance(groups, list) or len(groups) != len(self.param_groups):
            raise ValueError(
                f"optimizer state has {len(groups) if isinstance(groups, list) else 'no'} "
                f"parameter groups, this optimizer has {len(self.param_groups)}; was it saved "
                "for a different model or optimizer?"
            )
        for saved, inner in zip(groups, self.param_groups, strict=True):
            inner.update({k: v for k, v in saved.items() if k not in ("params", "step")})
        return int(groups[0].get("step") or 0) if groups else 0

    def parameter_state_dp_zero(
        self, buffers: list[FlatBuffer], window: int = 1 << 24
    ) -> dict[Any, Any] | None:
        """Megatron's `get_parameter_state_dp_zero`: the parameter state of the whole
        stage in `distrib_optim.pt`'s layout (see `megatron_buffers`), on data-parallel
        rank 0 (None elsewhere). Collective over the data-parallel group. The shards
        travel `window` elements at a time (a sum-reduce onto rank 0 of zero-filled
        windows, each element owned by one rank), so no other rank holds a full copy."""
        self.finish_param_sync()
        keys = ("param", *self._state_keys)
        where = self._buffer_positions(buffers)
        root = self.dp_rank == 0
        out: dict[Any, Any] | None = {"buckets_coalesced": True} if root else None
        device = self._buckets[0].main_param_shard.device if self._buckets else "cpu"
        for index, buffer in enumerate(buffers):
            pieces = sorted(
                (where[id(f.param)][1] + f.param_start, f)
                for f in self._fragments
                if where[id(f.param)][0] == index
            )
            world: dict[str, Any] = {}
            for key in keys:
                full = torch.zeros(buffer.numel_unpadded) if root else None
                for lo in range(0, buffer.numel_unpadded, window):
                    hi = min(lo + window, buffer.numel_unpadded)
                    part = torch.zeros(hi - lo, dtype=torch.float32, device=device)
                    for start, frag in pieces:
                        a, b = max(lo, start), min(hi, start + frag.numel)
                        if a < b:
                            value = self._fragment_value(frag, key)
                            part[a - lo : b - lo] = value[a - start : b - start]
                    if self.dp_size > 1:
                        dist.reduce(part, self._root_rank(), group=self.group)
                    if full is not None:
                        full[lo:hi] = part.cpu()
                world[key] = full
            if out is not None:
                out[index] = {buffer.dtypes: {**world, "numel_unpadded": buffer.numel_unpadded}}
        return out

    def load_parameter_state(
        self, state: dict[Any, Any], buffers: list[FlatBuffer], step: int, source: str
    ) -> None:
        """Load Megatron's `distrib_optim.pt` contents (from any data-parallel size):
        each rank copies its own fragments out of `state` (memory-mapped: only those
        pages are read). `step` comes from `load_param_groups_state`."""
        self.finish_param_sync()
        where = self._buffer_positions(buffers)
        keys = ("param", *self._state_keys)
        self.optimizer.state.clear()
        for frag in self._fragments:
            index, start = where[id(frag.param)]
            world = saved_buffer(state, buffers[index], index, source, keys)
            lo = start + frag.param_start
            frag.main.copy_(world["param"][lo : lo + frag.numel])
            if step > 0 and self._state_keys:
                inner = {
                    key: world[key][lo : lo + frag.numel].to(frag.main.device, torch.float32)
                    for key in self._state_keys
                }
                if self._stepped():
                    inner["step"] = torch.tensor(float(step), device=self._step_on(frag))
                self.optimizer.state[frag.main] = inner
        self._steps = step

    def _root_rank(self) -> int:
        return 0 if self.group is None else dist.get_global_rank(self.group, 0)

    def _buffer_positions(self, buffers: list[FlatBuffer]) -> dict[int, tuple[int, int]]:
        where = {
            id(p): (index, start)
            for index, buffer in enumerate(buffers)
            for p, start in zip(buffer.params, buffer.starts, strict=True)
        }
        missing = [f.index for f in self._fragments if id(f.param) not in where]
        if missing:
            raise ValueError(f"parameters {missing} are in no grad buffer of the model chunks")
        return where

    def _fragment_value(self, frag: _Fragment, key: str) -> Tensor:
        if key == "param":
            return frag.main
        value = self.optimizer.state.get(frag.main, {}).get(key)
        return value if value is not None else torch.zeros_like(frag.main)

    def _stepped(self) -> bool:
        """Adam and AdamW count steps per parameter; SGD does not."""
        return type(self.optimizer) is not torch.optim.SGD

    def _step_entry(self) -> dict[str, Tensor]:
        return {"step": torch.tensor(float(self._steps))} if self._stepped() else {}

    def _has_step(self, frag: _Fragment, stored: Callable[[int, str], bool]) -> bool:
        return not self._stepped() or stored(frag.index, "step")

    def _step_on(self, frag: _Fragment) -> torch.device | str:
        """A fused optimizer keeps its step count on the parameters' device, else the CPU."""
        return frag.main.device if self.optimizer.defaults.get("fused") else "cpu"

    def _checkpoint_view(self, frag: _Fragment, flat: Tensor) -> Tensor:
        """`flat` (a fragment-sized state tensor) as the chunks of the parameter's global
        tensor it covers (views: a save reads them, a load fills them)."""
        local = _local(frag.param)
        pieces = global_pieces(flat, frag.param_start, tuple(local.shape), axis_map_of(frag.param))
        return checkpoint_tensor(pieces, tuple(frag.param.shape), self._checkpoint_mesh(flat))

    def _checkpoint_mesh(self, like: Tensor) -> DeviceMesh | None:
        """A mesh holding this rank, for DCP's chunk wrappers (the data-parallel group's;
        none without a process group, where every fragment is a whole parameter)."""
        if not (dist.is_available() and dist.is_initialized()):
            return None
        kind = like.device.type
        if kind not in self._meshes:
            group = self.group if self.group is not None else dist.group.WORLD
            self._meshes[kind] = DeviceMesh.from_group(group, kind)
        return self._meshes[kind]

    # --- accounting ---------------------------------------------------------------------------

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds, by kind (what REFERENCE §7's table counts per parameter).

        params/grads: the full flat buffers; main_params: fp32 copies of the shard
        (none for fp32 parameters); main_grads: fp32 copies of the shard's gradient
        (fp16 only, made each step); optimizer_state: the inner optimizer's tensors."""
        out = {"params": 0, "grads": 0, "main_params": 0, "main_grads": 0, "optimizer_state": 0}
        for b in self._buckets:
            out["params"] += _nbytes(b.param_data)
            out["grads"] += _nbytes(b.grad_data)
            if b.main_param_shard.data_ptr() != b.param_shard.data_ptr():
                out["main_params"] += _nbytes(b.main_param_shard)
            if b.grad_data.dtype != torch.float32:
                out["main_grads"] += b.shard_size * 4
        for entry in self.optimizer.state.values():
            out["optimizer_state"] += sum(
                _nbytes(v) for v in entry.values() if isinstance(v, Tensor) and v.dim() > 0
            )
        return out


class _Done:
    """A finished collective (one rank: nothing to wait for)."""

    def wait(self) -> bool:
        return True


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _local(param: Tensor) -> Tensor:
    """What this rank stores of a parameter: a DTensor's local shard, else the tensor."""
    return param._local_tensor if isinstance(param, DTensor) else param


def _use_storage_of(param: nn.Parameter, view: Tensor) -> None:
    """Make the parameter's data (a DTensor's local shard) a view into the bucket."""
    if not isinstance(param, DTensor):
        param.data = view.view_as(param)
        return
    local = param._local_tensor
    if not local.is_contiguous():
        raise ValueError("the distributed optimizer needs contiguous tensor-parallel shards")
    param._local_tensor = view.view(local.shape)


def _has_main_copy(bucket: _Bucket) -> bool:
    """Non-fp32 parameters have fp32 main copies; fp32 ones are stepped in place."""
    return bucket.main_param_shard.data_ptr() != bucket.param_shard.data_ptr()


def _is_tp_sharded(param: Tensor) -> bool:
    return isinstance(param, DTensor) and any(not p.is_replicate() for p in param.placements)


def _is_partial_of_replicated(grad: DTensor, param: Tensor) -> bool:
    return all(p.is_partial() for p in grad.placements) and all(
        p.is_replicate() for p in param.placements
    )


def _tensor_parallel_group(params: list[nn.Parameter]) -> dist.ProcessGroup | None:
    """The (1-D) tensor-parallel mesh's group of the DTensor parameters, if any."""
    meshes = {p.device_mesh for p in params if isinstance(p, DTensor)}  # equal by ranks
    if not meshes:
        return None
    if len(meshes) > 1 or next(iter(meshes)).ndim != 1:
        raise ValueError("the distributed optimizer expects one 1-D tensor-parallel mesh")
    return next(iter(meshes)).get_group()


def _layout_order(params: list[nn.Parameter], model: nn.Module | None) -> list[nn.Parameter]:
    """Reverse model order (backward produces gradients roughly last layer first)."""
    if model is None:
        return list(reversed(params))
    wanted = {id(p) for p in params}
    ordered = [p for p in model.parameters() if id(p) in wanted]
    seen = {id(p) for p in ordered}
    missing = [p for p in params if id(p) not in seen]
    return list(reversed(ordered)) + missing


def _register_param_wait_hooks(
    model: nn.Module,
    bucket_of: dict[int, _Bucket],
    wait: Callable[[list[_Bucket]], None],
) -> list[Any]:
    """Forward pre-hooks: a module waits for the all-gather of its own parameters' buckets."""
    hooks = []
    for module in model.modules():
        buckets: list[_Bucket] = []
        for p in module.parameters(recurse=False):
            bucket = bucket_of.get(id(p))
            if bucket is not None and all(b is not bucket for b in buckets):
                buckets.append(bucket)
        if buckets:
            hooks.append(module.register_forward_pre_hook(lambda m, a, b=buckets: wait(b)))
        # The output layer's weight (or the last stage's tied embedding copy) is read by
        # `output_and_loss` without calling its module: the model waits for it up front.
        output_weight = getattr(module, "output_weight", None)
        if callable(output_weight):
            try:
                bucket = bucket_of.get(id(output_weight()))
            except (AttributeError, TypeError):  # a middle stage: no output weight
                bucket = None
            if bucket is not None:
                hooks.append(module.register_forward_pre_hook(lambda m, a, b=[bucket]: wait(b)))
    return hooks
