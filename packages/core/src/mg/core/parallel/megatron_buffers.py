"""Where Megatron-Core's grad buffers put each parameter: the layout of `distrib_optim.pt`.

In the `torch` checkpoint format Megatron saves the distributed optimizer's
parameter state (fp32 main parameters and Adam moments) in a separate
`mp_rank_XX/distrib_optim.pt`, as flat fp32 tensors in the coordinates of its
DDP grad buffers (`ParamAndGradBuffer`), with the padding at bucket ends
removed so the file does not depend on the data-parallel size:

    {"buckets_coalesced": True,
     0: {(param_dtype, grad_dtype): {"param": [N], "exp_avg": [N], "exp_avg_sq": [N],
                                     "numel_unpadded": N}},
     1: ...}                                   # one entry per model chunk and dtype

A buffer holds one model chunk's trainable parameters of one (param, grad)
dtype pair, in reverse `named_parameters()` order of Megatron's module tree;
with the distributed optimizer each parameter starts at a multiple of 64
elements from its bucket's start, and a shared embedding (the tied word
embedding of a pipeline's first and last stage) has a bucket of its own.
Buckets close once they reach the DDP bucket size, which is unbounded unless
gradients are reduced during backward (`--overlap-grad-reduce`).

This module computes that layout for our modules, so our files and Megatron's
are the same bytes in the same places.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from mg.core.parallel.dtensor_layout import shard_like

PARAM_ALIGNMENT = 64  # elements; Megatron aligns parameter starts to 128 bytes of bf16

# Megatron builds an attention module's output projection (in `Attention.__init__`)
# before its input projections and QK norms (in the subclass), so they come first in
# its `named_parameters()`; everything else follows the same order as ours.
_ATTENTION_CHILDREN = (
    "linear_proj",
    "linear_qkv",
    "linear_q",
    "linear_kv",
    "q_layernorm",
    "k_layernorm",
)
_ATTENTION_MODULES = ("self_attention", "cross_attention")


@dataclass(frozen=True)
class FlatBuffer:
    """One Megatron grad buffer: its dtype key, parameters and their flat starts."""

    dtypes: tuple[torch.dtype, torch.dtype]  # (parameter dtype, gradient dtype)
    params: tuple[nn.Parameter, ...]
    starts: tuple[int, ...]  # in the unpadded (bucket-end padding removed) coordinates
    numel_unpadded: int


def megatron_parameter_order(names: Sequence[str]) -> list[str]:
    """`names` (our `named_parameters()` order) in Megatron-Core's module order."""
    first_seen: dict[tuple[str, ...], int] = {}
    keys: dict[str, list[tuple[int, int]]] = {}
    for name in names:
        parts = name.split(".")
        key = []
        for depth, part in enumerate(parts):
            seen = first_seen.setdefault(tuple(parts[: depth + 1]), len(first_seen))
            fixed = len(_ATTENTION_CHILDREN)
            if depth and parts[depth - 1] in _ATTENTION_MODULES and part in _ATTENTION_CHILDREN:
                fixed = _ATTENTION_CHILDREN.index(part)
            key.append((fixed, seen))
        keys[name] = key
    return sorted(names, key=keys.__getitem__)


def grad_dtype_of(param: Tensor) -> torch.dtype:
    """Our gradient buffers: fp16 for fp16 parameters, fp32 otherwise (Megatron's
    `--accumulate-allreduce-grads-in-fp32`, on by default with bf16)."""
    return torch.float16 if param.dtype == torch.float16 else torch.float32


def megatron_buffers(
    chunks: Sequence[nn.Module],
    *,
    bucket_size: int | None = None,
    shared_embedding: Callable[[nn.Parameter], bool] = lambda p: False,
    include: Callable[[nn.Parameter], bool] = lambda p: True,
) -> list[FlatBuffer]:
    """The grad buffers Megatron-Core's DDP would build for these model chunks, in its
    order (chunk by chunk, dtype pairs by first appearance); `bucket_size` None means
    one bucket per buffer (no `--overlap-grad-reduce`). `include` picks the parameters:
    Megatron's DDP keeps expert-parallel experts in buffers of their own
    (`expert_parallel_buffers`), laid out the same way."""
    buffers = []
    for chunk in chunks:
        named = dict(chunk.named_parameters())
        by_dtype: dict[tuple[torch.dtype, torch.dtype], list[nn.Parameter]] = {}
        for name in megatron_parameter_order(list(named)):
            param = named[name]
            if param.requires_grad and include(param):
                by_dtype.setdefault((param.dtype, grad_dtype_of(param)), []).append(param)
        for dtypes, params in by_dtype.items():
            buffers.append(_buffer(dtypes, params, bucket_size, shared_embedding))
    return buffers


def _buffer(
    dtypes: tuple[torch.dtype, torch.dtype],
    params: list[nn.Parameter],
    bucket_size: int | None,
    shared_embedding: Callable[[nn.Parameter], bool],
) -> FlatBuffer:
    """Megatron's `_ParamAndGradBuffer` walk, in unpadded coordinates: within a bucket a
    parameter starts at a multiple of 64 from the bucket's start; a new bucket starts
    where the previous one's last parameter ended."""
    order, starts = [], []
    bucket_start = 0  # unpadded coordinate of the open bucket's start
    offset = 0  # next free element, relative to the open bucket's start
    open_bucket = False
    for param in reversed(params):
        numel = _local_numel(param)
        own_bucket = shared_embedding(param)
        offset = _align(offset)
        if own_bucket and open_bucket:  # close the bucket (its alignment padding included)
            bucket_start, offset, open_bucket = bucket_start + offset, 0, False
        order.append(param)
        starts.append(bucket_start + offset)
        offset += numel
        open_bucket = True
        if own_bucket or (bucket_size is not None and offset >= bucket_size):
            bucket_start, offset, open_bucket = bucket_start + offset, 0, False
    return FlatBuffer(dtypes, tuple(order), tuple(starts), bucket_start + offset)


def _align(offset: int) -> int:
    return -(-offset // PARAM_ALIGNMENT) * PARAM_ALIGNMENT


def _local_numel(param: Tensor) -> int:
    return (param._local_tensor if isinstance(param, DTensor) else param).numel()


def saved_buffer(
    state: dict[Any, Any], buffer: FlatBuffer, index: int, source: str, keys: Sequence[str]
) -> dict[str, Tensor]:
    """Grad buffer `index` of a loaded `distrib_optim.pt`, checked against ours."""
    entry = state.get(index)
    if not isinstance(entry, dict) or len(entry) != 1:
        raise ValueError(
            f"{source}: no grad buffer {index}; it was saved for a model with a different "
            "number of model chunks or parameter dtypes"
        )
    world = next(iter(entry.values()))
    if world.get("numel_unpadded") != buffer.numel_unpadded:
        raise ValueError(
            f"{source}: grad buffer {index} holds {world.get('numel_unpadded')} elements, "
            f"this model's has {buffer.numel_unpadded}; it was saved for a different model "
            "or with a different --ddp-bucket-size / --overlap-grad-reduce"
        )
    missing = [k for k in keys if k not in world]
    if missing:
        raise ValueError(
            f"{source}: grad buffer {index} has no {', '.join(missing)}; it was saved for a "
            "different optimizer"
        )
    return world


def torch_optimizer_state(
    optimizer: torch.optim.Optimizer,
    saved_groups: list[dict[str, Any]],
    state: dict[Any, Any],
    buffers: list[FlatBuffer],
    source: str,
) -> dict[str, Any]:
    """A plain torch optimizer's `state_dict()` rebuilt from Megatron's torch-format pair
    (the groups of `model_optim_rng.pt`, the flat state of `distrib_optim.pt`), so a run
    without the distributed optimizer resumes one that had it. Full-size, as the plain
    optimizer's own state is."""
    where = {
        id(p): (index, start)
        for index, buffer in enumerate(buffers)
        for p, start in zip(buffer.params, buffer.starts, strict=True)
    }
    step = float(saved_groups[0].get("step") or 0) if saved_groups else 0.0
    out: dict[int, dict[str, Any]] = {}
    groups, position = [], 0
    for group, saved in zip(optimizer.param_groups, saved_groups, strict=True):
        members = []
        for param in group["params"]:
            index, start = where[id(param)]
            world = saved_buffer(state, buffers[index], index, source, ("param",))
            local = param._local_tensor if isinstance(param, DTensor) else param
            stepped = step and not isinstance(optimizer, torch.optim.SGD)
            entry: dict[str, Any] = {"step": torch.tensor(step)} if stepped else {}
            for key, flat in world.items():
                if key in ("param", "numel_unpadded") or step == 0:
                    continue
                piece = flat[start : start + local.numel()].view(local.shape).clone()
                entry[key] = shard_like(piece, param) if isinstance(param, DTensor) else piece
            out[position] = entry
            members.append(position)
            position += 1
        groups.append({**{k: v for k, v in saved.items() if k != "step"}, "params": members})
    return {"state": out if step else {}, "param_groups": groups}
