"""megatron-core's `dist_checkpointing` on CPU: a `torch_dist` save as Megatron-LM makes it,
and a load into megatron-core's GPTModel, for the tests that check our format against it.

`megatron_cpu_patches` (megatron_reference) covers the forward; saving needs two
more: the writer synchronises CUDA after copying to host, and collects its write
results through a queue served by a spawned process (seconds to start, and useless
for a synchronous save), here a plain in-process queue.
"""

from __future__ import annotations

import argparse
import queue
from pathlib import Path
from typing import Any

import torch

from mg.core.checkpoint.rng import get_rng_state


def dist_checkpointing_cpu_patches(patches: Any) -> None:
    """Add to `patches` (a pytest.MonkeyPatch) what a synchronous save needs on CPU."""
    # lazy: megatron-core is a test-only dependency
    import megatron.core.dist_checkpointing.strategies.filesystem_async as filesystem_async

    patches.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    patches.setattr(filesystem_async, "_get_write_results_queue", lambda: queue.Queue())


def save_like_megatron_lm(
    save_dir: Path,
    model: torch.nn.Module,
    args: argparse.Namespace,
    iteration: int,
    *,
    position: tuple[int, int] = (0, 0),
    sizes: tuple[int, int] = (1, 1),
    data_parallel_rank: int = 0,
) -> Path:
    """Megatron-LM's `save_checkpoint` with `--ckpt-format torch_dist --no-save-optim` for
    this rank's `model` (collective): `generate_state_dict`'s entries, its `rng_state`
    ShardedObject for the (pipeline, tensor) `position` of `sizes`, and the tracker file.
    megatron-core's GPTModel has no CUDA generators here: the state is mg's (same dicts)."""
    # lazy: megatron-core is a test-only dependency
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    folder = save_dir / f"iter_{iteration:07d}"
    rank = torch.distributed.get_rank()
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    state = {
        "args": args,
        "checkpoint_version": 3.0,
        "iteration": iteration,
        "model": model.sharded_state_dict(),
        "rng_state": ShardedObject(
            "rng_state", [get_rng_state()], sizes, position, replica_id=data_parallel_rank
        ),
        "num_floating_point_operations_so_far": 0,
    }
    dist_checkpointing.save(state, str(folder), content_metadata={"singleton_local_shards": False})
    torch.distributed.barrier()
    if rank == 0:
        (save_dir / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return folder


def load_into_megatron(folder: Path, model: torch.nn.Module) -> None:
    """megatron-core's `dist_checkpointing.load` of the model (its default strictness, as
    Megatron-LM's `load_checkpoint`), then a strict `load_state_dict`. Megatron-LM
    registers its safe globals (the args Namespace among them) at start-up: so here."""
    # lazy: megatron-core is a test-only dependency
    from megatron.core import dist_checkpointing
    from megatron.core.safe_globals import register_safe_globals

    register_safe_globals()

    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(folder))
    model.load_state_dict(loaded["model"], strict=True)


def megatron_sharded_keys(model: torch.nn.Module) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """megatron-core's own `sharded_state_dict()` of `model`: each tensor key's global shape
    (a SwiGLU factory's from its data: [L?, E?, 2F, h]) and the `_extra_state` objects'
    DCP keys: what a checkpoint in Megatron-Core's layout must hold."""
    # lazy: megatron-core is a test-only dependency
    from megatron.core.dist_checkpointing.mapping import (
        ShardedObject,
        ShardedTensor,
        ShardedTensorFactory,
    )

    tensors: dict[str, tuple[int, ...]] = {}
    objects: set[str] = set()
    for value in model.sharded_state_dict().values():
        if isinstance(value, ShardedObject):
            objects.add(value.unique_key)
        elif isinstance(value, ShardedTensorFactory):
            built = value.build()
            built = list(built.values()) if isinstance(built, dict) else list(built)
            if len({b.key for b in built}) > 1:  # split into named row blocks (Mamba's)
                tensors.update({b.key: tuple(b.global_shape) for b in built})
            else:  # chunks of one tensor (SwiGLU's [gate; up])
                shape = tuple(built[0].global_shape[:-2]) + tuple(value.data.shape)
                tensors[value.key] = shape
        elif isinstance(value, ShardedTensor):
            tensors[value.key] = tuple(value.global_shape)
    return tensors, objects
