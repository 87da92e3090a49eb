"""The optimizer of a fully sharded model, with the distributed optimizer's interface.

The torch optimizer inside steps the DTensor shards `fully_shard` left, so each
rank keeps the state of its shard only. Around it, what the training step asks
of any optimizer that reduces gradients itself (`DistributedOptimizer`'s
methods): `no_sync` for every micro-batch but the last, `finish_grad_sync`,
`unscale_and_check` under loss scaling and `clip_grad_norm` over every shard.
The trainer then needs no branch of its own for FSDP.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from mg.core.parallel.collective_device import collective_device
from mg.core.parallel.expert_parallel import is_expert_parameter
from mg.core.parallel.fully_sharded import clip_grad_norm, no_gradient_sync


class FullyShardedOptimizer:
    """`optimizer` over the parameters of `model`, which `apply_fully_shard` sharded (or a
    model left whole: one data-parallel rank)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module,
        expert_group: dist.ProcessGroup | None = None,
        expert_grad_scale: float = 1.0,
        reduce_every_micro_batch: bool = False,
    ) -> None:
        self.optimizer = optimizer
        self.model = model
        self.reduce_every_micro_batch = reduce_every_micro_batch
        """Reduce-scatter each micro-batch's gradients into the sharded ones (the strategies
        that shard gradients, as Megatron-FSDP does): accumulating them unreduced would
        hold every layer's whole gradient until the last micro-batch."""
        self.expert_group = expert_group
        """The expert-parallel group (expert parallelism only): its ranks hold other experts."""
        self.expert_grad_scale = expert_grad_scale
        """Expert data-parallel size / (data × context size): FSDP averaged the experts'
        gradients over their replicas, the dense ones over every data × context rank."""

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's groups: the LR scheduler sets `lr` here."""
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Accumulate this micro-batch's gradients without reducing them (unless they are
        reduced every micro-batch)."""
        if self.reduce_every_micro_batch:
            return contextlib.nullcontext()
        return no_gradient_sync(self.model)

    @torch.no_grad()
    def finish_grad_sync(self) -> None:
        """FSDP reduce-scattered each unit's gradients as its last backward ended; the
        experts' are brought to the dense ones' scale (expert parallelism only)."""
        if self.expert_grad_scale == 1.0:
            return
        for param in self._params():
            if param.grad is not None and is_expert_parameter(param):
                grad = param.grad
                (grad.to_local() if isinstance(grad, DTensor) else grad).mul_(
                    self.expert_grad_scale
                )

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def _params(self) -> Iterator[nn.Parameter]:
        for group in self.optimizer.param_groups:
            yield from group["params"]

    @torch.no_grad()
    def unscale_and_check(self, scale: float) -> bool:
        """Divide the shards' gradients by the loss scale; True if any rank found inf/NaN."""
        found = torch.zeros((), dtype=torch.float32)
        for param in self._params():
            if param.grad is None:
                continue
            grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
            if scale != 1.0:
                grad.mul_(1.0 / scale)
            found = torch.maximum(found, (~torch.isfinite(grad)).any().float().cpu())
        if dist.is_initialized() and dist.get_world_size() > 1:
            device = collective_device()
            found = found.to(device)
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
        return bool(found > 0)

    def clip_grad_norm(self, max_norm: float) -> float:
        """The global L2 norm over every shard (before clipping), clipped to `max_norm` if
        > 0; NaN when it is not finite (the step is skipped)."""
        norm = clip_grad_norm(list(self._params()), max_norm, self.expert_group)
        return norm if math.isfinite(norm) else float("nan")

    def step(self) -> None:
        self.optimizer.step()

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)
