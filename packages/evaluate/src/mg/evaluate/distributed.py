"""Data parallel evaluation under torchrun: every rank scores a strided share of the
examples and the results are gathered, so the numbers equal a one-process run.

The share is taken over a process ``group``: the whole world by default, or the
data-parallel group of a tensor/pipeline-parallel layout
(:mod:`mg.evaluate.model_parallel`), whose model-parallel ranks score the same share
together. Without ``torchrun`` (``WORLD_SIZE`` unset or 1) everything here is a
no-op. The backend is NCCL on GPUs and gloo on CPU.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

T = TypeVar("T")


def init_from_env() -> tuple[int, int]:
    """(rank, world size); starts the process group when torchrun asked for several ranks."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    return rank_and_world()


def rank_and_world(group: ProcessGroup | None = None) -> tuple[int, int]:
    """This rank's index in ``group`` (default: the world) and the group's size."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def is_main() -> bool:
    return rank_and_world()[0] == 0


def shard(items: Sequence[T], group: ProcessGroup | None = None) -> list[T]:
    """This rank's share: items ``rank, rank + world, ...`` (rank and world in ``group``)."""
    rank, world = rank_and_world(group)
    return list(items[rank::world])


def unshard(local: list[T], total: int, group: ProcessGroup | None = None) -> list[T]:
    """Inverse of :func:`shard`: every rank gets all results, in the original order."""
    world = rank_and_world(group)[1]
    if world == 1:
        return local
    gathered: list[list[T] | None] = [None] * world
    dist.all_gather_object(gathered, local, group=group)
    out: list[T | None] = [None] * total
    for r, part in enumerate(gathered):
        out[r::world] = part  # type: ignore[index]
    return out  # type: ignore[return-value]


def all_reduce_sum(values: Sequence[float], group: ProcessGroup | None = None) -> list[float]:
    """Sums over the ranks of ``group`` (default: all), in float64 (on the GPU with NCCL)."""
    if rank_and_world(group)[1] == 1:
        return list(values)
    device = torch.device("cuda") if dist.get_backend(group) == "nccl" else torch.device("cpu")
    tensor = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(tensor, group=group)
    return tensor.tolist()


def average_gradients(parameters: Sequence[torch.nn.Parameter]) -> None:
    """Mean of the gradients over ranks (what DDP does), for the finetune loop."""
    world = rank_and_world()[1]
    if world == 1:
        return
    for p in parameters:
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad.div_(world)
