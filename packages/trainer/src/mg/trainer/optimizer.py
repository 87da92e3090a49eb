"""The optimizer: AdamW or SGD, Megatron's weight-decay groups, gradient clipping.

Megatron's "adam" is Adam with decoupled weight decay (apex FusedAdam in
adam_w_mode), i.e. `torch.optim.AdamW`. Biases and every 1-D parameter (norm
weights) get no weight decay; embeddings and matrices do, as in Megatron's
`_get_param_groups`. With `--decoupled-lr` the input embedding and the output
layer (Megatron's `is_embedding_or_output_parameter`: `word_embeddings.weight`
and `output_layer.weight`) get groups of their own whose `max_lr`/`min_lr` the
schedule reads instead of `--lr`/`--min-lr`.

`--use-distributed-optimizer` wraps the same torch optimizer in
`mg.core.parallel.distributed_optimizer.DistributedOptimizer`: each
data-parallel rank keeps the state of its shard only, gradients are
reduce-scattered instead of all-reduced, and its state dict is the plain torch
optimizer's, so checkpoints move freely between the two and between DP sizes.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from mg.core.parallel.distributed_optimizer import DistributedOptimizer
from mg.core.parallel.expert_optimizer import ExpertParallelDistributedOptimizer
from mg.core.parallel.grad_norm import clip_grad_norm as parallel_clip_grad_norm
from mg.trainer.arguments import DistributedArgs, OptimizerArgs

EMBEDDING_OR_OUTPUT = ("embedding.word_embeddings.weight", "output_layer.weight")


def is_embedding_or_output(name: str) -> bool:
    """Megatron's `is_embedding_or_output_parameter`: the word embeddings and output layer."""
    return any(name == n or name.endswith("." + n) for n in EMBEDDING_OR_OUTPUT)


def param_groups(
    model: nn.Module,
    weight_decay: float,
    decoupled_lr: float | None = None,
    decoupled_min_lr: float | None = None,
) -> list[dict]:
    """Decayed matrices/embeddings and undecayed biases and norm weights; with
    `decoupled_lr`, the embedding/output parameters in groups of their own (listed
    last, so group 0 keeps the base learning rate the log line prints)."""
    buckets: dict[tuple[bool, bool], list[nn.Parameter]] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        decayed = not (name.endswith(".bias") or param.dim() == 1)
        decoupled = decoupled_lr is not None and is_embedding_or_output(name)
        buckets.setdefault((decoupled, decayed), []).append(param)
    groups = []
    for decoupled in (False, True):
        for decayed in (True, False):
            params = buckets.get((decoupled, decayed))
            if not params:
                continue
            group = {"params": params, "weight_decay": weight_decay if decayed else 0.0}
            if decoupled:
                group["max_lr"] = decoupled_lr
                if decoupled_min_lr is not None:
                    group["min_lr"] = decoupled_min_lr
            groups.append(group)
    return groups


def build_optimizer(
    model: nn.Module,
    args: OptimizerArgs,
    dist_args: DistributedArgs | None = None,
    dp_group: torch.distributed.ProcessGroup | None = None,
    expert_groups: tuple[Any, Any] | None = None,
    **pipeline: Any,
) -> torch.optim.Optimizer | DistributedOptimizer:
    """AdamW (`--optimizer adam`) or SGD with momentum (`--optimizer sgd`), sharded over
    `dp_group` (default: the world) with `--use-distributed-optimizer`; `pipeline`: a
    pipeline stage's groups and tied weight for it (`pipeline_optimizer_options`);
    `expert_groups`: (expert-data-parallel, expert-parallel) groups under expert
    parallelism, whose experts the distributed optimizer shards apart."""
    groups = param_groups(model, args.weight_decay, args.decoupled_lr, args.decoupled_min_lr)
    groups = groups or [{"params": [], "weight_decay": 0.0}]  # a stage of frozen layers only
    if dist_args is not None and dist_args.use_distributed_optimizer:
        kind: Any = DistributedOptimizer
        if expert_groups is not None:
            kind = partial(
                ExpertParallelDistributedOptimizer,
                expert_dp_group=expert_groups[0],
                ep_group=expert_groups[1],
            )
        return kind(
            groups,
            lambda inner: _torch_optimizer(inner, args),
            dp_group=dp_group,
            bucket_size=dist_args.ddp_bucket_size,
            overlap_grad_reduce=dist_args.overlap_grad_reduce,
            overlap_param_gather=dist_args.overlap_param_gather,
            model=model,
            grad_reduce_dtype=torch.bfloat16 if dist_args.grad_reduce_in_bf16 else None,
            **pipeline,
        )
    return _torch_optimizer(groups, args)


def _fuses(groups: list[dict]) -> bool:
    """Whether torch's fused AdamW takes these parameters: plain tensors, or DTensors all on
    one device mesh (its one kernel over a list mixes neither plain tensors with DTensors,
    as tensor parallelism leaves some, nor meshes, as experts beside dense parameters)."""
    params = [p for g in groups for p in g["params"]]
    meshes = {id(p.device_mesh) for p in params if isinstance(p, DTensor)}
    return not meshes or (len(meshes) == 1 and all(isinstance(p, DTensor) for p in params))


def _torch_optimizer(groups: list[dict], args: OptimizerArgs) -> torch.optim.Optimizer:
    if args.optimizer == "adam":
        return torch.optim.AdamW(
            groups,
            lr=args.lr,
            betas=(args.adam_beta1, args.adam_beta2),
            eps=args.adam_eps,
            weight_decay=args.weight_decay,
            # One kernel for all tensors (Megatron's fused Adam), deterministic, over FSDP's
            # DTensor shards too (each rank steps its local part); where `_fuses` says the
            # kernel refuses the mix, one tensor at a time.
            **({"fused": True} if _fuses(groups) else {"foreach": False}),
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
