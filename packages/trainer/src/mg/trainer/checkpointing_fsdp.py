"""Training checkpoints in the `fsdp_dtensor` format (`--ckpt-format fsdp_dtensor`).

The tensors are `mg.core.checkpoint.fsdp_dtensor`'s (the state-dict API's keys, every
rank writing its own FSDP shards); the rest is what `torch_dist` keeps in common.pt:
`args` with the consumed-sample counters, `iteration`, `opt_param_scheduler`,
`grad_scaler`, the `mg` configs, and rank 0's generators. A resume at the same
layout continues bit for bit; at another data-parallel size, or without FSDP, the
weights and the optimizer state are resharded by DCP.

A fully sharded run also reads and writes `torch_dist` (`checkpointing_dist`: FSDP's
DTensor shards are pieces of the global tensors there like tensor parallelism's); a
`torch` checkpoint (one file per model-parallel rank) is refused at load, naming
`--ckpt-format`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from mg.core.checkpoint import (
    RELEASE,
    checkpoint_dir,
    get_rng_state,
    mg_metadata,
    read_latest_iteration,
    set_rng_state,
)
from mg.core.checkpoint.dist_format import PendingSave, load_dist_checkpoint, save_dist_checkpoint
from mg.core.checkpoint.fsdp_dtensor import (
    FORMAT_KEY,
    FSDP_DTENSOR,
    copy_objects,
    is_fsdp_dtensor,
    load_sharded_state,
    sharded_state,
    writable,
)
from mg.core.checkpoint.layout import CheckpointError
from mg.core.models.moe.expert_names import (
    global_expert_names,
    inverse,
    rename_keys,
    rename_optimizer_state,
)
from mg.core.parallel.distributed_optimizer import DistributedOptimizer
from mg.core.parallel.fully_sharded_optimizer import FullyShardedOptimizer
from mg.trainer import distributed
from mg.trainer.checkpointing import TrainState
from mg.trainer.checkpointing_dist import common_state
from mg.trainer.model_parallel import PipelineModel


def is_fully_sharded(model: nn.Module) -> bool:
    return isinstance(distributed.unwrap(model), FSDPModule)


def _torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer whose state is saved (inside the FSDP one)."""
    if isinstance(optimizer, FullyShardedOptimizer):
        return optimizer.optimizer
    if isinstance(optimizer, DistributedOptimizer):
        raise CheckpointError(
            f"--ckpt-format {FSDP_DTENSOR} holds a plain optimizer's state, not the "
            "distributed optimizer's; load it with --no-load-optim, or without "
            "--use-distributed-optimizer"
        )
    return optimizer


def _renamed(state: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """`sharded_state`'s dict with the routed experts' keys renamed where `names` says (the
    tensors are the same objects): under expert parallelism each rank names its experts
    from 0, the checkpoint by their number in the whole layer."""
    renamed = {**state, "model": rename_keys(state["model"], names)}
    if "optimizer" in state:
        renamed["optimizer"] = rename_optimizer_state(state["optimizer"], names)
    return renamed


def _check_model(model: nn.Module) -> None:
    if isinstance(model, PipelineModel):
        raise CheckpointError(
            f"--ckpt-format {FSDP_DTENSOR} is read and written without pipeline parallelism; "
            "drop --pipeline-model-parallel-size"
        )


def save(
    save_dir: str,
    state: TrainState,
    *,
    args_flat: dict[str, Any],
    model: nn.Module,
    optimizer: Any,
    scheduler: Any,
    loss_scaler: Any,
    model_config: dict[str, Any],
    tokenizer_config: dict[str, Any] | None,
    parallel: dict[str, int],
    save_optim: bool = True,
    save_rng: bool = True,
    async_save: bool = False,
) -> PendingSave:
    """Collective: every rank writes its shards; rank 0 writes common.pt and commits."""
    model = distributed.unwrap(model)
    _check_model(model)
    sharded = sharded_state(model, _torch_optimizer(optimizer) if save_optim else None)
    sharded = _renamed(sharded, global_expert_names(model))
    common = {
        FORMAT_KEY: FSDP_DTENSOR,
        **common_state(
            state, args_flat, mg_metadata(model_config, tokenizer_config, **parallel),
            (scheduler, loss_scaler) if save_optim else None,
        ),
    }  # fmt: skip
    if save_rng:
        common["rng_state"] = [get_rng_state()]
    return save_dist_checkpoint(
        save_dir, state.iteration, writable(sharded), common, async_save=async_save
    )


def resume(
    load_dir: str,
    *,
    model: nn.Module,
    optimizer: Any,
    scheduler: Any,
    loss_scaler: Any,
    finetune: bool = False,
    load_optim: bool = True,
    load_rng: bool = True,
    iteration: int | None = None,
) -> TrainState:
    """Load the fsdp_dtensor checkpoint (latest, or `iteration`) into this rank's objects,
    sharded or whole."""
    model = distributed.unwrap(model)
    iteration = read_latest_iteration(load_dir) if iteration is None else iteration
    folder = Path(checkpoint_dir(load_dir, iteration))
    if not is_fsdp_dtensor(folder):
        raise CheckpointError(
            f"{folder}: a fully sharded run (--use-megatron-fsdp / --use-torch-fsdp2) loads "
            f"--ckpt-format {FSDP_DTENSOR} or torch_dist checkpoints; this one is a torch "
            "checkpoint (load it without FSDP, then save it with --ckpt-format torch_dist)"
        )
    _check_model(model)
    finetune = finetune or iteration == RELEASE
    want_optim = load_optim and not finetune
    inner = _torch_optimizer(optimizer) if want_optim else None
    experts = global_expert_names(model)
    sharded = _renamed(sharded_state(model, inner), experts)
    ready = writable(sharded)  # views: the load fills `sharded`'s tensors
    common = load_dist_checkpoint(folder, ready, allow_pickle=True)
    copy_objects(ready, sharded)
    load_sharded_state(model, inner, _renamed(sharded, inverse(experts)))
    if want_optim:
        scheduler.load_state_dict(common["opt_param_scheduler"])
        if "grad_scaler" in common:
            loss_scaler.load_state_dict(common["grad_scaler"])
    if finetune:
        return TrainState()
    if load_rng:
        if "rng_state" not in common:
            raise CheckpointError(f"{load_dir}: the checkpoint has no RNG state; use --no-load-rng")
        set_rng_state(common["rng_state"])
    saved = common.get("args")
    return TrainState(
        iteration=int(common["iteration"]),
        consumed_train_samples=int(getattr(saved, "consumed_train_samples", 0)),
        consumed_valid_samples=int(getattr(saved, "consumed_valid_samples", 0)),
        skipped_iterations=int(getattr(saved, "skipped_train_iterations", 0)),
        num_floating_point_operations_so_far=float(
            common.get("num_floating_point_operations_so_far", 0.0)
        ),
    )
