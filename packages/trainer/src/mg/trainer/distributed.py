"""Data parallelism: process group from the torchrun environment, DDP, Megatron's sampler.

- `init_distributed` reads RANK/WORLD_SIZE/LOCAL_RANK (torchrun) and starts
  NCCL on GPU or gloo on CPU; a plain `mg-train` run stays single-process.
- `--overlap-grad-reduce` wraps the model in torch's DistributedDataParallel,
  whose bucketed all-reduce runs during backward. Without it the gradients are
  all-reduced once after the last micro-batch's backward (`allreduce_gradients`),
  as Megatron does without overlap. Both average over data-parallel ranks.
- `MegatronPretrainingSampler` hands each rank its micro-batches in Megatron's
  order: from `consumed_samples` on, every `micro_batch_size * dp` consecutive
  sample indices are split by rank, so a global batch is the same set of samples
  whatever the DP size.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.tensor import DTensor

from mg.core.parallel.collective_device import collective_device


@dataclass
class DistEnv:
    """Where this process sits; rank 0 of 1 without torchrun."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def read_world_size() -> int:
    """WORLD_SIZE from torchrun, 1 otherwise (needed before flags are validated)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(backend: str | None = None, timeout_minutes: float | None = None) -> DistEnv:
    """Join the process group torchrun describes (gloo on CPU, NCCL on GPU).

    `timeout_minutes` (`--distributed-timeout-minutes`) bounds every collective."""
    world_size = read_world_size()
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() and backend != "gloo"
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(
            backend=backend or ("nccl" if use_cuda else "gloo"),
            rank=rank,
            world_size=world_size,
            device_id=device if use_cuda else None,
            timeout=timedelta(minutes=timeout_minutes) if timeout_minutes else None,
        )
    return DistEnv(rank, world_size, local_rank, device)


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def wrap_model(
    model: nn.Module, overlap: bool, bucket_size: int | None, reduce_in_bf16: bool = False
) -> nn.Module:
    """DDP when overlapping gradient reduction with backward, else the model itself;
    `reduce_in_bf16` (--grad-reduce-in-bf16): DDP's buckets travel in bf16."""
    if not (overlap and is_distributed()):
        return model
    kwargs = {}
    if bucket_size is not None:
        # DDP sizes buckets in MiB; Megatron's flag is in elements (fp32 here).
        kwargs["bucket_cap_mb"] = bucket_size * 4 / 2**20
    device_ids = [torch.cuda.current_device()] if next(model.parameters()).is_cuda else None
    # Expert-parallel experts (allreduce=False) differ between the data-parallel ranks: DDP
    # leaves them alone, they are reduced over their expert-data-parallel group (moe_step).
    experts = [n for n, p in model.named_parameters() if getattr(p, "allreduce", True) is False]
    if experts:
        nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            model, experts
        )
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=device_ids, **kwargs)
    if reduce_in_bf16:
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    return ddp


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def allreduce_gradients(
    model: nn.Module, group: dist.ProcessGroup | None = None, reduce_in_bf16: bool = False
) -> None:
    """Average gradients over data-parallel ranks after backward (the no-overlap path).

    `group` is the data-parallel (× context-parallel) group; the whole world by default.
    `reduce_in_bf16` (--grad-reduce-in-bf16): as Megatron, the gradients are divided by
    the group size first and summed in bf16."""
    if not is_distributed() or isinstance(model, nn.parallel.DistributedDataParallel):
        return
    if group is not None and dist.get_world_size(group) == 1:
        return
    # expert-parallel experts (allreduce=False) are averaged over their own group (moe_step)
    grads = [
        _local(p.grad)
        for p in model.parameters()
        if p.grad is not None and getattr(p, "allreduce", True)
    ]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    if reduce_in_bf16:
        flat /= dist.get_world_size(group)
        reduced = flat.to(torch.bfloat16)
        dist.all_reduce(reduced, group=group)
        flat = reduced.to(flat.dtype)
    else:
        dist.all_reduce(flat, group=group)
        flat /= dist.get_world_size(group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def _local(grad: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel (DTensor) gradient's local shard: data parallelism averages shards."""
    return grad.to_local() if isinstance(grad, DTensor) else grad


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (a no-op on one process); returns a CPU tensor."""
    if not is_distributed():
        return tensor
    moved = tensor.to(collective_device())
    dist.all_reduce(moved)
    return moved.cpu()


def all_reduce_max(value: float) -> float:
    if not is_distributed():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


class MegatronPretrainingSampler:
    """Megatron's sampler: index batches of `micro_batch_size` for one data-parallel rank.

    Continues from `consumed_samples` (so a resumed run sees the samples it would
    have seen); stops before a partial `micro_batch_size * dp` chunk.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
    ) -> None:
        if total_samples <= 0:
            raise ValueError(f"no samples to train on (total_samples={total_samples})")
        if consumed_samples >= total_samples:
            raise ValueError(
                f"no samples left to consume: {consumed_samples} consumed of {total_samples}"
            )
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.rank = data_parallel_rank
        self.chunk = micro_batch_size * data_parallel_size

    def __iter__(self) -> Iterator[list[int]]:
        start = self.rank * self.micro_batch_size
        for first in range(self.consumed_samples, self.total_samples - self.chunk + 1, self.chunk):
            yield list(range(first + start, first + start + self.micro_batch_size))
