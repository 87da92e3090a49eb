"""Training checkpoints in Megatron's `torch_dist` format (`--ckpt-format torch_dist`).

The tensors — the model's and the optimizer's, keyed by parameter name — go
through `mg.core.checkpoint.dist_format` (torch.distributed.checkpoint), every
rank writing its own shards, so the checkpoint loads into any tensor- or
data-parallel layout. Everything else is the `torch` format's content in
`common.pt`: `args` (with the consumed-sample counters), `iteration`,
`opt_param_scheduler`, `grad_scaler`, `rng_state`,
`num_floating_point_operations_so_far` and the `mg` configs.

`--async-save` returns as soon as the state is copied to host memory; the
trainer waits for the previous save before the next one and before exiting.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from mg.core.checkpoint import (
    CHECKPOINT_VERSION,
    RELEASE,
    checkpoint_dir,
    get_rng_state,
    mg_metadata,
    read_latest_iteration,
    set_rng_state,
)
from mg.core.checkpoint.dist_format import (
    PendingSave,
    is_torch_dist,
    load_dist_checkpoint,
    save_dist_checkpoint,
    stored_tensors,
)
from mg.core.models.rng_stream import restore_tracker_states, tracker_states
from mg.core.parallel.distributed_optimizer import DistributedOptimizer
from mg.core.parallel.dtensor_layout import shard_like
from mg.trainer import distributed
from mg.trainer.checkpointing import TrainState


def _named_globally(model: nn.Module) -> nn.Module:
    """A pipeline rank's chunks as one module with the whole model's parameter names, so
    the checkpoint's keys do not depend on the pipeline layout (it reshards across PP)."""
    from mg.core.parallel.pipeline import global_view
    from mg.trainer.model_parallel import PipelineModel

    return global_view(model.chunks) if isinstance(model, PipelineModel) else model


_PLACEHOLDER = "<read from the checkpoint>"


def _names(model: nn.Module, optimizer: DistributedOptimizer) -> list[str]:
    """The distributed optimizer's parameters by name, in its state's index order."""
    name_of = {id(p): name for name, p in model.named_parameters()}
    return [name_of[id(p)] for p in optimizer.params]


def _optimizer_state(model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name, as torch's `get_optimizer_state_dict`
    writes it (`state.<name>.exp_avg`, `param_groups.<i>.params` = names).

    The distributed optimizer's is its full, gathered state (collective; the same on every
    data-parallel rank, so DCP writes each tensor once): the checkpoint does not depend on
    the data-parallel size and loads into the plain optimizer and back."""
    if not isinstance(optimizer, DistributedOptimizer):
        return get_optimizer_state_dict(model, optimizer)
    full = optimizer.state_dict()
    names = _names(model, optimizer)
    return {
        "state": {names[i]: entry for i, entry in full["state"].items()},
        "param_groups": [
            {**g, "params": [names[i] for i in g["params"]]} for g in full["param_groups"]
        ],
    }


def _optimizer_request(folder: Path, model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """What to read for the optimizer: this rank's own layout for a torch optimizer; the
    full stored tensors of every parameter for the distributed optimizer (it slices its
    shard on `load_state_dict`)."""
    if not isinstance(optimizer, DistributedOptimizer):
        return get_optimizer_state_dict(model, optimizer)
    stored = stored_tensors(folder, "optimizer.state.")
    state: dict[str, dict[str, torch.Tensor]] = {}
    for name, param in zip(_names(model, optimizer), optimizer.params, strict=True):
        prefix = f"optimizer.state.{name}."
        entry = {
            key[len(prefix) :]: _in_layout_of(param, value)
            for key, value in stored.items()
            if key.startswith(prefix) and "." not in key[len(prefix) :]
        }
        if entry:
            state[name] = entry
    # Non-tensor entries are read whole in place of these placeholders (None is skipped).
    groups = [{k: _PLACEHOLDER for k in g} for g in optimizer.param_groups]
    return {"state": state, "param_groups": groups}


def _in_layout_of(param: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel parameter's state is read as its shard (DCP reshards to it)."""
    if not isinstance(param, DTensor) or stored.shape != param.shape:
        return stored
    return shard_like(torch.empty_like(param._local_tensor, dtype=stored.dtype), param)


def _with_members(groups: list[dict], members: list[list], load_dir: str) -> list[dict]:
    """The stored groups' options with this rank's parameters as members: a group's stored
    names are one pipeline stage's (DCP keeps one copy of a non-tensor entry)."""
    if len(groups) != len(members):
        raise ValueError(
            f"{load_dir}: the checkpoint's optimizer has {len(groups)} parameter groups, this "
            f"model's has {len(members)}; was it saved for a different model or optimizer?"
        )
    return [{**g, "params": m} for g, m in zip(groups, members, strict=True)]


def _load_optimizer(
    model: nn.Module, optimizer: Any, loaded: dict[str, Any], load_dir: str
) -> None:
    if not isinstance(optimizer, DistributedOptimizer):
        ours = [g["params"] for g in get_optimizer_state_dict(model, optimizer)["param_groups"]]
        loaded["param_groups"] = _with_members(loaded["param_groups"], ours, load_dir)
        set_optimizer_state_dict(model, optimizer, loaded)
        return
    index = {name: i for i, name in enumerate(_names(model, optimizer))}
    groups = _with_members(loaded["param_groups"], optimizer.group_members(), load_dir)
    state = {index[name]: entry for name, entry in loaded["state"].items()}
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def save(
    save_dir: str,
    state: TrainState,
    *,
    args_flat: dict[str, Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    loss_scaler: Any,
    model_config: dict[str, Any],
    tokenizer_config: dict[str, Any],
    parallel: dict[str, int],
    save_optim: bool = True,
    save_rng: bool = True,
    async_save: bool = False,
    rng_shard: str | None = None,
) -> PendingSave:
    """Collective: every rank writes its shards; rank 0 writes common.pt and commits.

    `rng_shard` names this rank's (tensor, pipeline) position: the tensor-parallel
    dropout stream, which differs between those positions, is stored under it."""
    model = _named_globally(distributed.unwrap(model))
    if isinstance(optimizer, DistributedOptimizer):
        optimizer.finish_param_sync()  # the model's weights are complete only after this
    sharded: dict[str, Any] = {"model": model.state_dict()}
    if save_optim:
        sharded["optimizer"] = _optimizer_state(model, optimizer)
    common = {
        "args": argparse.Namespace(
            **args_flat,
            iteration=state.iteration,
            consumed_train_samples=state.consumed_train_samples,
            consumed_valid_samples=state.consumed_valid_samples,
            skipped_train_iterations=state.skipped_iterations,
        ),
        "checkpoint_version": CHECKPOINT_VERSION,
        "num_floating_point_operations_so_far": state.num_floating_point_operations_so_far,
        "mg": mg_metadata(model_config, tokenizer_config, **parallel),
    }
    if save_optim:
        common["opt_param_scheduler"] = scheduler.state_dict()
        common["grad_scaler"] = loss_scaler.state_dict()
    if save_rng:
        # Identical on every rank (the trainer seeds them alike; data order is indexed).
        common["rng_state"] = [get_rng_state()]
        streams = tracker_states()
        if rng_shard is not None and streams:
            sharded["rng"] = {rng_shard: streams}
    return save_dist_checkpoint(save_dir, state.iteration, sharded, common, async_save=async_save)


def latest_is_torch_dist(load_dir: str) -> bool:
    """Whether `load_dir`'s latest checkpoint is a torch_dist one (the format is detected)."""
    iteration = read_latest_iteration(load_dir)
    if iteration is None:
        return False
    return is_torch_dist(checkpoint_dir(load_dir, iteration))


def resume(
    load_dir: str,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    loss_scaler: Any,
    finetune: bool = False,
    load_optim: bool = True,
    load_rng: bool = True,
    rng_shard: str | None = None,
) -> TrainState:
    """Load the latest torch_dist checkpoint into this rank's (possibly sharded) objects
    (`rng_shard`: as for `save`; a stream saved in another layout is not restored)."""
    model = _named_globally(distributed.unwrap(model))
    iteration = read_latest_iteration(load_dir)
    folder = Path(checkpoint_dir(load_dir, iteration))
    # A `release` checkpoint (converted weights) loads like --finetune, as in Megatron.
    finetune = finetune or iteration == RELEASE
    want_optim = load_optim and not finetune
    sharded: dict[str, Any] = {"model": model.state_dict()}
    if want_optim:
        sharded["optimizer"] = _optimizer_request(folder, model, optimizer)
    streams = {}
    if load_rng and not finetune and rng_shard is not None:
        prefix = f"rng.{rng_shard}."
        streams = {k[len(prefix) :]: v for k, v in stored_tensors(folder, prefix).items()}
        if streams:
            sharded["rng"] = {rng_shard: streams}
    common = load_dist_checkpoint(folder, sharded)
    if want_optim:
        _load_optimizer(model, optimizer, sharded["optimizer"], load_dir)
        scheduler.load_state_dict(common["opt_param_scheduler"])
        if "grad_scaler" in common:
            loss_scaler.load_state_dict(common["grad_scaler"])
    elif isinstance(optimizer, DistributedOptimizer):
        optimizer.reload_model_params()  # its main copies must follow the loaded weights
    if finetune:
        return TrainState()
    if load_rng:
        if "rng_state" not in common:
            raise ValueError(f"{load_dir}: the checkpoint has no RNG state; use --no-load-rng")
        set_rng_state(common["rng_state"])
        restore_tracker_states(streams)
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
