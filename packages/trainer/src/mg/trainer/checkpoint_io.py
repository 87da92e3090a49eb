"""The trainer's one way to its checkpoints: what cannot be saved, resuming, saving.

    layout = check_savable(c.ckpt_format, model_config, family=args.family)  # at start-up
    state = resume(c.load, model=..., optimizer=..., ..., layout=parallel_layout)
    pending = save(c.save, state, ckpt_format=c.ckpt_format, model=..., ...)

One format per kind of file (`mg.core.checkpoint.formats`), each with its reader
and writer here:

- `torch`: one `model_optim_rng.pt` per model-parallel rank (`checkpointing`);
- `torch_dist`: a torch.distributed.checkpoint folder every rank writes its shards
  into (`checkpointing_dist`), its keys in the layout the model's configuration
  gives (Megatron-Core's for a GPT, local or Transformer Engine spec; mg's
  per-parameter one for MoE, Mamba, BERT and T5), read in either layout;
- `fsdp_dtensor`: a torch_dist folder with the state-dict API's keys, FSDP's shards
  as they are (`checkpointing_fsdp`). A fully sharded run reads and writes it and
  `torch_dist` (its DTensor shards are pieces of the global tensors like any other).

`resume` finds the format on disk (whatever `--ckpt-format` says), `save` writes
the one asked for.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from mg.core.checkpoint import checkpoint_dir, read_latest_iteration
from mg.core.checkpoint.dist_format import PendingSave, is_torch_dist
from mg.core.checkpoint.formats import TORCH, TORCH_DIST, check_savable, require_writer
from mg.core.checkpoint.fsdp_dtensor import FSDP_DTENSOR, is_fsdp_dtensor
from mg.core.checkpoint.layout import CheckpointError, Iteration
from mg.core.models.config import TransformerConfig
from mg.core.parallel.layout import ParallelLayout
from mg.trainer import checkpointing, checkpointing_dist, checkpointing_fsdp
from mg.trainer.arguments.checkpointing import ASSUME_OK
from mg.trainer.checkpointing import TrainState

__all__ = ["PendingSave", "TrainState", "check_savable", "resume", "save", "saved_format"]


def saved_format(load: str, iteration: Iteration | None = None) -> str | None:
    """The format of `load`'s latest checkpoint (or of `iteration`): `fsdp_dtensor` for a
    complete DCP folder whose common.pt says so, `torch_dist` for another, `torch`
    otherwise; None when `load` names no checkpoint."""
    iteration = read_latest_iteration(load) if iteration is None else iteration
    if iteration is None:
        return None
    folder = checkpoint_dir(load, iteration)
    if is_fsdp_dtensor(folder):
        return FSDP_DTENSOR
    return TORCH_DIST if is_torch_dist(folder) else TORCH


def resume(
    load: str,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    loss_scaler: Any,
    finetune: bool = False,
    load_optim: bool = True,
    load_rng: bool = True,
    iteration: int | None = None,
    layout: ParallelLayout | None = None,
    strictness: str = ASSUME_OK,
) -> TrainState | None:
    """Load `load`'s latest checkpoint (or `iteration`: `--ckpt-step`) into this rank's
    objects, in whichever format it was saved; None when there is none.

    `layout`: the run's parallel layout (None: one process). `--finetune`, or a
    `release` checkpoint, loads the weights only and starts at iteration 0.
    `strictness`: `--dist-ckpt-strictness`, for a torch_dist checkpoint."""
    what: dict[str, Any] = {
        "model": model,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "loss_scaler": loss_scaler,
        "finetune": finetune,
        "load_optim": load_optim,
        "load_rng": load_rng,
        "iteration": iteration,
    }
    found = saved_format(load, iteration)
    fully_sharded = checkpointing_fsdp.is_fully_sharded(model)
    if found == FSDP_DTENSOR or (fully_sharded and found != TORCH_DIST):  # or its refusal
        return checkpointing_fsdp.resume(load, **what)
    if found == TORCH_DIST:
        rng_shard = layout.shard_name if layout is not None else None
        return checkpointing_dist.resume(load, **what, rng_shard=rng_shard, strictness=strictness)
    # no checkpoint at all (None) is the torch reader's to report, as it always was
    return checkpointing.resume(load, **what, layout=layout)


def save(
    save_dir: str,
    state: TrainState,
    *,
    ckpt_format: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    loss_scaler: Any,
    model_config: TransformerConfig | Mapping[str, Any],
    tokenizer_config: Mapping[str, Any] | None,
    args_flat: dict[str, Any],
    save_optim: bool = True,
    save_rng: bool = True,
    async_save: bool = False,
    layout: ParallelLayout | None = None,
) -> PendingSave | None:
    """Save this iteration in `ckpt_format` (collective: every rank calls it).

    `torch_dist` returns its `PendingSave` (with `async_save`, still being written:
    `wait()` on it before the next save and before exiting); `torch` is written when
    this returns (None). `args_flat`: `Args.flat()`, whose `model_family` with
    `model_config` gives the `torch_dist` key layout. `layout`: the run's parallel
    layout (None: one process)."""
    require_writer(ckpt_format)
    config = dict(
        model_config.to_dict() if isinstance(model_config, TransformerConfig) else model_config
    )
    common: dict[str, Any] = {
        "args_flat": args_flat,
        "model": model,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "loss_scaler": loss_scaler,
        "model_config": config,
        "tokenizer_config": tokenizer_config,
        "save_optim": save_optim,
        "save_rng": save_rng,
    }
    if ckpt_format == FSDP_DTENSOR:
        parallel = {} if layout is None else {"tp": layout.tp, "pp": layout.pp, "cp": layout.cp}
        return checkpointing_fsdp.save(
            save_dir, state, **common, parallel=parallel, async_save=async_save
        )
    if ckpt_format == TORCH_DIST:
        parallel = {} if layout is None else {"tp": layout.tp, "pp": layout.pp, "cp": layout.cp}
        rng_shard = layout.shard_name if layout is not None else None
        return checkpointing_dist.save(
            save_dir,
            state,
            **common,
            parallel=parallel,
            async_save=async_save,
            rng_shard=rng_shard,
        )
    if async_save:
        raise CheckpointError(f"--async-save needs --ckpt-format {TORCH_DIST}")
    checkpointing.save(save_dir, state, **common, layout=layout)
    return None
