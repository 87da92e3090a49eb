"""The optimizer: AdamW or SGD, Megatron's weight-decay groups, gradient clipping.

Megatron's "adam" is Adam with decoupled weight decay (apex FusedAdam in
adam_w_mode), i.e. `torch.optim.AdamW`. Biases and every 1-D parameter (norm
weights) get no weight decay; embeddings and matrices do, as in Megatron's
`_get_param_groups`.

`--use-distributed-optimizer` wraps the same torch optimizer in
`mg.core.parallel.distributed_optimizer.DistributedOptimizer`: each
data-parallel rank keeps the state of its shard only, gradients are
reduce-scattered instead of all-reduced, and its state dict is the plain torch
optimizer's, so checkpoints move freely between the two and between DP sizes.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from mg.core.parallel.distributed_optimizer import DistributedOptimizer
from mg.core.parallel.grad_norm import clip_grad_norm as parallel_clip_grad_norm
from mg.trainer.arguments import DistributedArgs, OptimizerArgs


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: decayed matrices/embeddings, and undecayed biases and norm weights."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if name.endswith(".bias") or param.dim() == 1:
            no_decay.append(param)
        else:
            decay.append(param)
    groups = []
    if decay:
        groups.append({"params": decay, "weight_decay": weight_decay})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(
    model: nn.Module,
    args: OptimizerArgs,
    dist_args: DistributedArgs | None = None,
    dp_group: torch.distributed.ProcessGroup | None = None,
    **pipeline: Any,
) -> torch.optim.Optimizer | DistributedOptimizer:
    """AdamW (`--optimizer adam`) or SGD with momentum (`--optimizer sgd`), sharded over
    `dp_group` (default: the world) with `--use-distributed-optimizer`; `pipeline`: a
    pipeline stage's groups and tied weight for it (`pipeline_optimizer_options`)."""
    groups = param_groups(model, args.weight_decay)
    if dist_args is not None and dist_args.use_distributed_optimizer:
        return DistributedOptimizer(
            groups,
            lambda inner: _torch_optimizer(inner, args),
            dp_group=dp_group,
            bucket_size=dist_args.ddp_bucket_size,
            overlap_grad_reduce=dist_args.overlap_grad_reduce,
            overlap_param_gather=dist_args.overlap_param_gather,
            model=model,
            **pipeline,
        )
    return _torch_optimizer(groups, args)


def _has_dtensor(groups: list[dict]) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for g in groups for p in g["params"])


def _torch_optimizer(groups: list[dict], args: OptimizerArgs) -> torch.optim.Optimizer:
    if args.optimizer == "adam":
        return torch.optim.AdamW(
            groups,
            lr=args.lr,
            betas=(args.adam_beta1, args.adam_beta2),
            eps=args.adam_eps,
            weight_decay=args.weight_decay,
            # One kernel for all tensors (Megatron's fused Adam), deterministic; torch's fused
            # kernel does not take DTensors (tensor parallelism without the distributed
            # optimizer), which step one tensor at a time.
            **({"foreach": False} if _has_dtensor(groups) else {"fused": True}),
        )
    if args.optimizer == "sgd":
        return torch.optim.SGD(
            groups, lr=args.lr, momentum=args.sgd_momentum, weight_decay=args.weight_decay
        )
    raise ValueError(f"unknown optimizer {args.optimizer!r}; expected adam or sgd")


def clip_grad_norm(model: nn.Module, clip_grad: float) -> float:
    """The global L2 norm of the gradients (before clipping), clipped to `clip_grad` if > 0.

    The norm is computed on the full (all-reduced) gradients, so every data-parallel
    rank sees the same value. A non-finite norm is returned as is (the caller skips).
    """
    params = [p for p in model.parameters() if p.grad is not None]
    if getattr(model, "tensor_parallel_size", 1) > 1:  # DTensor shards: norm over TP ranks
        value = parallel_clip_grad_norm(params, clip_grad)
        return value if math.isfinite(value) else float("nan")
    if clip_grad > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, clip_grad, foreach=False)
    else:
        norm = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(p.grad.float()) for p in params])
        )
    value = float(norm)
    return value if math.isfinite(value) else float("nan")
