"""Transformer Engine's modules in a tensor- and context-parallel model, driven as TE's API says.

`apply_transformer_engine` swaps TE's modules into a model that tensor and
context parallelism have already been applied to (from outside, as for the
local spec: DTensor parameters, `RingAttention`). TE's modules then do the
communication themselves, told so the way Megatron's TE spec tells them:

- `LayerNormLinear`/`Linear` get `tp_group`, `tp_size`,
  `parallel_mode="column"` (linear_qkv, linear_fc1) or `"row"` (linear_proj,
  linear_fc2) and `sequence_parallel`. TE allocates this rank's shard shapes;
  the module then holds the model's own parameters (DTensors, so checkpoints,
  the optimizer and the gradient norm see them unchanged) and, for each
  forward, lends TE their local shards (`DTensor.to_local`, as FSDP2 lends TE
  unsharded ones). A replicated parameter whose gradient TE leaves as a
  partial sum under sequence parallelism (a column module's norm weights, a row
  module's bias; Megatron all-reduces those in finalize_model_grads) is lent
  with a partial gradient placement, so `sync_tensor_parallel_grads` sums it.
- TE's sequence parallelism gathers and scatters along the first dimension
  (Megatron's [s, b, h]); our activations are [b, s, h], so a sequence-parallel
  module sees its input transposed to sequence-first and returns batch-first. The
  transposed input is handed over contiguous: TE's `prepare_forward` would copy a
  strided one before its forward `view`s it as (-1, in_features), so the copy is
  made here, once, where it is visible.
- `DotProductAttention` gets the tensor-parallel group and size (it takes the
  whole model's head counts and divides them itself), and under context
  parallelism `cp_group`, `cp_global_ranks`, a side `cp_stream` and
  `cp_comm_type="p2p"`; the batch is already split into Megatron's
  load-balanced chunks (`mg.core.parallel.context_parallel.shard_batch`), the
  layout TE's context parallelism expects.

Everything goes through NCCL-capable collectives (TE's own, or DTensor's).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial


@dataclass(frozen=True)
class TEParallelism:
    """The process groups TE's modules communicate over (None: no such parallelism)."""

    tp_group: dist.ProcessGroup | None = None
    sequence_parallel: bool = False
    cp_group: dist.ProcessGroup | None = None

    @property
    def tp_size(self) -> int:
        return 1 if self.tp_group is None else dist.get_world_size(self.tp_group)

    @property
    def cp_size(self) -> int:
        return 1 if self.cp_group is None else dist.get_world_size(self.cp_group)

    def linear_kwargs(self, parallel_mode: str) -> dict[str, Any]:
        """TE `Linear`/`LayerNormLinear` arguments for a column or row module."""
        if self.tp_size == 1:
            return {}
        return dict(
            tp_group=self.tp_group,
            tp_size=self.tp_size,
            parallel_mode=parallel_mode,
            sequence_parallel=self.sequence_parallel,
        )

    def attention_kwargs(self) -> dict[str, Any]:
        """TE `DotProductAttention` arguments (one side stream shared by every layer)."""
        kwargs: dict[str, Any] = {}
        if self.tp_size > 1:
            kwargs.update(
                tp_group=self.tp_group,
                tp_size=self.tp_size,
                sequence_parallel=self.sequence_parallel,
            )
        if self.cp_size > 1:
            kwargs.update(
                cp_group=self.cp_group,
                cp_global_ranks=dist.get_process_group_ranks(self.cp_group),
                cp_stream=_cp_stream(),
                cp_comm_type="p2p",
            )
        return kwargs


@functools.cache
def _cp_stream() -> Any:
    """The CUDA stream TE overlaps context-parallel exchanges on (None without CUDA)."""
    return torch.cuda.Stream() if torch.cuda.is_available() else None


@functools.cache
def _sharded_class(te_class: type) -> type:
    """`te_class` with a forward that takes our activations and lends TE local shards."""

    class Sharded(te_class):
        """TE's module (same state), holding the model's DTensor parameters; see the
        module doc of mg.core.models.te_parallel."""

        mg_sequence_parallel = False
        mg_partial_grads: tuple[str, ...] = ()

        def forward(self, inp: Tensor, *args: Any, **kwargs: Any) -> Tensor:
            if isinstance(inp, DTensor):
                inp = inp.to_local()
            if self.mg_sequence_parallel:
                inp = inp.transpose(0, 1).contiguous()  # TE's sequence dim is the first
            owned = dict(self._parameters)
            try:
                for name, param in owned.items():
                    if isinstance(param, DTensor):
                        grad = [Partial()] if name in self.mg_partial_grads else None
                        self._parameters[name] = param.to_local(grad_placements=grad)
                out = super().forward(inp, *args, **kwargs)
            finally:
                self._parameters.update(owned)
            if self.mg_sequence_parallel:
                out = out.transpose(0, 1).contiguous()
            return out

    Sharded.__name__ = Sharded.__qualname__ = te_class.__name__
    return Sharded


_PARAMETERS = ("weight", "bias", "layer_norm_weight", "layer_norm_bias")
_SP_MARK = "sequence_parallel"  # the attribute TE sets on a parameter (reset_parameters)


def sharded_te_module(
    te_class: type, old: nn.Module, parallel: TEParallelism, parallel_mode: str, **kwargs: Any
) -> nn.Module:
    """A TE `Linear`/`LayerNormLinear` in `parallel_mode` replacing the tensor-parallel
    `old` (whole sizes in `kwargs`, as TE wants them), holding `old`'s parameters."""
    new = _sharded_class(te_class)(**kwargs, **parallel.linear_kwargs(parallel_mode))
    new.mg_sequence_parallel = parallel.sequence_parallel
    # The parameters TE's reset_parameters marks `sequence_parallel` (a column module's
    # norms, a row module's bias): replicated, their gradients partial sums per rank,
    # which Megatron's finalize_model_grads all-reduces by that mark.
    new.mg_partial_grads = tuple(
        name for name in _PARAMETERS if getattr(getattr(new, name, None), _SP_MARK, False)
    )
    for name in _PARAMETERS:
        mine = getattr(old, name, None)
        if mine is None:
            continue
        local = mine.to_local() if isinstance(mine, DTensor) else mine
        theirs = getattr(new, name)
        if tuple(theirs.shape) != tuple(local.shape):
            raise ValueError(
                f"TE {te_class.__name__}({parallel_mode}) allocates {name} of shape "
                f"{tuple(theirs.shape)} but this rank's shard is {tuple(local.shape)}"
            )
        nn.Module.register_parameter(new, name, mine)  # TE's own copy is dropped
    return new
