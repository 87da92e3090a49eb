"""What a training checkpoint holds; the files themselves are `mg.core.checkpoint`'s job.

A checkpoint is Megatron's `torch` layout with Megatron's keys (`args`,
`iteration`, `model`, `optimizer`, `opt_param_scheduler`, `rng_state`,
`num_floating_point_operations_so_far`) plus our `mg` entry with the model and
tokenizer configs, so `mg-eval --load` and `mg-serve --load` need no flags.
With the distributed optimizer, `optimizer` holds only the groups' options and
step count and the parameter state goes to `distrib_optim.pt` beside it, in the
flat layout of Megatron-Core's grad buffers, written by data-parallel rank 0
(`DistributedOptimizer.parameter_state_dp_zero`), as Megatron-LM does.
`args` is an `argparse.Namespace` of plain values with Megatron's names,
including `consumed_train_samples` and `consumed_valid_samples`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from mg.core.checkpoint import (
    CheckpointError,
    checkpoint_dir,
    find_rank_file,
    get_rng_state,
    load_checkpoint,
    mg_metadata,
    read_latest_iteration,
    save_checkpoint,
    set_rng_state,
)
from mg.core.checkpoint.layout import DISTRIB_OPTIM_FILENAME
from mg.core.checkpoint.serialization import load_file
from mg.core.checkpoint.te_extra_state import te_pickle_refusal
from mg.core.models.rng_stream import restore_tracker_states, tracker_states
from mg.core.parallel.distributed_optimizer import DistributedOptimizer
from mg.core.parallel.dtensor_layout import shard_like
from mg.core.parallel.expert_optimizer import ExpertParallelDistributedOptimizer
from mg.core.parallel.megatron_buffers import megatron_buffers, torch_optimizer_state
from mg.core.parallel.pipeline import shared_embedding_weight
from mg.core.quantization.apply import recorded_quantization
from mg.trainer import distributed
from mg.trainer.model_parallel import PipelineModel


@dataclass
class TrainState:
    """The counters that survive a restart."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    skipped_iterations: int = 0
    num_floating_point_operations_so_far: float = 0.0


def saved_args(args_flat: dict[str, Any], state: TrainState) -> argparse.Namespace:
    """Megatron's `args` entry of a checkpoint: the run's flags, with the counters a
    resume continues from (iteration, consumed samples, skipped iterations)."""
    return argparse.Namespace(
        **args_flat,
        iteration=state.iteration,
        consumed_train_samples=state.consumed_train_samples,
        consumed_valid_samples=state.consumed_valid_samples,
        skipped_train_iterations=state.skipped_iterations,
    )


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
    save_optim: bool = True,
    save_rng: bool = True,
    layout: Any = None,
) -> None:
    """Save on every rank: one rank per (tp, pp) shard writes `mp_rank_TT[_PPP]`, the others
    join the barriers. `layout` is the trainer's `ParallelLayout` (None: one shard)."""
    is_main = not distributed.is_distributed() or torch.distributed.get_rank() == 0
    writer = is_main if layout is None else layout.writes_checkpoint
    # Collective for the distributed optimizer (it gathers its shards onto data-parallel
    # rank 0), so every rank asks; it also waits for in-flight parameter all-gathers
    # before the model is read.
    optimizer_state, extra_files = None, {}
    sharded = isinstance(optimizer, (DistributedOptimizer, ExpertParallelDistributedOptimizer))
    if save_optim and sharded:
        optimizer_state = optimizer.param_groups_state()
        if isinstance(optimizer, ExpertParallelDistributedOptimizer):
            # Megatron's ChainedOptimizer: [dense, experts], each from its group's rank 0
            param_state = optimizer.parameter_state_dp_zero(_chunk_list(model))
        else:
            param_state = optimizer.parameter_state_dp_zero(
                optimizer.megatron_buffers(_chunk_list(model))
            )
        if param_state is not None:
            extra_files[DISTRIB_OPTIM_FILENAME] = param_state
    elif save_optim:
        optimizer_state = optimizer.state_dict()
    if writer and save_optim and sharded and not extra_files:
        raise RuntimeError("the checkpoint writer is not the distributed optimizer's rank 0")
    if extra_files and not writer:
        raise RuntimeError("a distributed optimizer's rank 0 is not a checkpoint writer")
    payload = None
    if writer:
        payload = {
            "args": saved_args(args_flat, state),
            "iteration": state.iteration,
            **_model_states(model),
            "num_floating_point_operations_so_far": state.num_floating_point_operations_so_far,
            "mg": mg_metadata(
                model_config,
                tokenizer_config,
                dp=args_flat["data_parallel_size"],
                **_parallel_sizes(layout),
            ),
        }
        if save_optim:
            payload["optimizer"] = optimizer_state
            payload["opt_param_scheduler"] = scheduler.state_dict()
            payload["grad_scaler"] = loss_scaler.state_dict()
        if save_rng:
            # One entry per data-parallel rank in Megatron; ours are identical on all ranks
            # except for the data, which is indexed, not random, so rank 0's entry suffices.
            # per (tp, pp) file: the tensor-parallel dropout stream is this rank's own
            payload["rng_state"] = [get_rng_state(tracker_states())]
    save_checkpoint(
        save_dir,
        state.iteration,
        payload,
        **_shard_position(layout),
        is_writer_of_latest=is_main,
        barrier=distributed.barrier if distributed.is_distributed() else None,
        extra_files=extra_files,
    )


def _chunk_list(model: nn.Module) -> list[nn.Module]:
    """The model chunks Megatron's grad buffers are built over (one for a whole model)."""
    return _chunks(model) or [distributed.unwrap(model)]


def _tied_embedding(model: nn.Module) -> nn.Parameter | None:
    """A pipeline stage's copy of the tied embedding (Megatron's `shared_embedding`)."""
    chunks = _chunks(model)
    return shared_embedding_weight(chunks) if chunks is not None else None


def _chunks(model: nn.Module) -> list[nn.Module] | None:
    """A pipeline rank's model chunks, or None for a whole model."""
    return list(model) if isinstance(model, PipelineModel) else None


def _model_states(model: nn.Module) -> dict[str, Any]:
    """Megatron's model entries: `model`, or `model0`, `model1`… per virtual stage."""
    chunks = _chunks(model)
    if chunks is None:
        return {"model": _picklable(distributed.unwrap(model).state_dict())}
    if len(chunks) == 1:
        return {"model": _picklable(chunks[0].state_dict())}
    return {f"model{i}": _picklable(chunk.state_dict()) for i, chunk in enumerate(chunks)}


def _picklable(state: dict[str, Any]) -> dict[str, Any]:
    """torch.save cannot pickle a DTensor whose local shard starts inside a larger buffer
    (the distributed optimizer's flat buckets): such shards are saved from a compact copy."""
    return {key: _compact(value) for key, value in state.items()}


def _compact(value: Any) -> Any:
    if not isinstance(value, DTensor) or value._local_tensor.storage_offset() == 0:
        return value
    return shard_like(value.to_local().clone(), value)


def _load_model_states(model: nn.Module, ckpt: dict[str, Any], path: str) -> None:
    chunks = _chunks(model)
    if chunks is None:
        _load_fitting(distributed.unwrap(model), ckpt["model"], path)
        return
    keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    missing = [k for k in keys if k not in ckpt]
    if missing:
        raise ValueError(
            f"{path}: the checkpoint has no {', '.join(missing)} entry; it was saved with a "
            "different --num-layers-per-virtual-pipeline-stage (use the same value to load it)"
        )
    for chunk, key in zip(chunks, keys, strict=True):
        _load_fitting(chunk, ckpt[key], path)


def _load_fitting(module: nn.Module, saved: dict[str, Any], path: str) -> None:
    """`load_state_dict`, its many-line RuntimeError (one line per tensor) summed up in one
    line that is the same on every rank: the shapes compared are the global ones."""
    try:
        module.load_state_dict(saved)
    except RuntimeError as error:
        if (refusal := te_pickle_refusal(error, path)) is not None:  # TE's FP8 state
            raise refusal from None
        raise CheckpointError(
            f"{path}: the checkpoint's weights do not fit this run's model "
            f"({weights_mismatch(module.state_dict(), saved, error)}); resume with the model "
            "flags it was saved with (--use-checkpoint-args reads them from it), or start a "
            "new run with another --save"
        ) from None


def weights_mismatch(model: dict[str, Any], saved: dict[str, Any], error: Exception) -> str:
    """What differs between a model's state dict and a checkpoint's, in a few words."""
    differ = [
        f"{name}: {tuple(saved[name].shape)} in the checkpoint, {tuple(value.shape)} in the model"
        for name, value in model.items()
        if name in saved
        and hasattr(value, "shape")
        and hasattr(saved[name], "shape")
        and tuple(value.shape) != tuple(saved[name].shape)
    ]
    missing = [name for name in model if name not in saved]
    unexpected = [name for name in saved if name not in model]
    parts = []
    if differ:
        parts.append(f"{len(differ)} tensors differ in shape, e.g. {differ[0]}")
    if missing:
        parts.append(f"{len(missing)} missing from the checkpoint, e.g. {missing[0]}")
    if unexpected:
        parts.append(f"{len(unexpected)} not in the model, e.g. {unexpected[0]}")
    if not parts:  # something else load_state_dict refused
        return str(error).strip().splitlines()[-1].strip()
    return "; ".join(parts)


def _check_group_count(groups: list[Any], optimizer: Any, load_dir: str) -> None:
    """Parameter groups come from the model and the flags that split it (weight decay,
    --decoupled-lr): a different count means a different model or different flags."""
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"{load_dir}: the optimizer state has {len(groups)} parameter groups, this run's "
            f"optimizer has {len(optimizer.param_groups)} (a different model, or "
            "--decoupled-lr given on one side only); resume with the saved run's flags, or "
            "with --no-load-optim"
        )


def _load_optimizer(
    optimizer: Any,
    state: dict[str, Any],
    model: nn.Module,
    load_dir: str,
    iteration: Any,
    position: dict[str, int],
) -> None:
    """The optimizer from either `torch`-format layout: the full state in
    `model_optim_rng.pt` (a plain optimizer's), or Megatron's distributed-optimizer pair
    (groups there, parameter state in `distrib_optim.pt`, memory-mapped: each rank reads
    only its own fragments)."""
    if isinstance(optimizer, ExpertParallelDistributedOptimizer):
        _load_chained_optimizer(optimizer, state, model, load_dir, iteration, position)
        return
    if isinstance(state, list) or (isinstance(state, dict) and "state" in state):
        if isinstance(state, list):  # Megatron's ChainedOptimizer: experts apart
            raise CheckpointError(
                f"{load_dir}: the optimizer state was saved with the experts apart "
                "(--expert-model-parallel-size > 1 or --expert-tensor-parallel-size 1) and "
                "--use-distributed-optimizer; resume with the same flags, or with "
                "--no-load-optim"
            )
        _check_group_count(state.get("param_groups") or [], optimizer, load_dir)
        optimizer.load_state_dict(state)
        return
    folder = checkpoint_dir(load_dir, iteration)
    rank_file, _ = find_rank_file(
        folder,
        position.get("tp_rank", 0),
        position.get("pp_rank", 0),
        position.get("pp_size"),
        position.get("ep_rank", 0),
    )
    path = rank_file.parent / DISTRIB_OPTIM_FILENAME
    if not path.is_file():
        raise CheckpointError(
            f"{path} is missing: the checkpoint was saved with the distributed optimizer and "
            "its parameter state is not there; copy it back, or resume with --no-load-optim"
        )
    param_state = load_file(path, mmap=True)
    if isinstance(optimizer, DistributedOptimizer):
        step = optimizer.load_param_groups_state(state)
        buffers = optimizer.megatron_buffers(_chunk_list(model))
        optimizer.load_parameter_state(param_state, buffers, step, str(path))
        return
    groups = (state.get("optimizer") or {}).get("param_groups") or []
    _check_group_count(groups, optimizer, load_dir)
    tied = _tied_embedding(model)
    buffers = megatron_buffers(_chunk_list(model), shared_embedding=lambda p: p is tied)
    optimizer.load_state_dict(
        torch_optimizer_state(optimizer, groups, param_state, buffers, str(path))
    )


def _load_chained_optimizer(
    optimizer: ExpertParallelDistributedOptimizer,
    state: Any,
    model: nn.Module,
    load_dir: str,
    iteration: Any,
    position: dict[str, int],
) -> None:
    """The distributed optimizer with the experts apart from Megatron's torch-format pair:
    each part's state is in the `distrib_optim.pt` its group's rank 0 wrote (the dense
    part's data-parallel rank 0, the experts' expert-data-parallel rank 0), which with
    --expert-tensor-parallel-size 1 may be another tensor-parallel rank's file."""
    if isinstance(state, dict) and "state" in state:
        raise CheckpointError(
            f"{load_dir}: the optimizer state was saved without --use-distributed-optimizer "
            "or without the experts apart; resume with the same flags, or with --no-load-optim"
        )
    folder = checkpoint_dir(load_dir, iteration)
    mine = (position.get("tp_rank", 0), position.get("ep_rank", 0))
    files, sources = [], []
    for tp_rank, ep_rank in optimizer.distrib_optim_sources(mine):
        rank_file, _ = find_rank_file(
            folder, tp_rank, position.get("pp_rank", 0), position.get("pp_size"), ep_rank
        )
        path = rank_file.parent / DISTRIB_OPTIM_FILENAME
        if not path.is_file():
            raise CheckpointError(
                f"{path} is missing: the checkpoint was saved with the distributed optimizer "
                "and its parameter state is not there; copy it back, or resume with "
                "--no-load-optim"
            )
        files.append(load_file(path, mmap=True))
        sources.append(str(path))
    try:
        optimizer.load_parameter_states(state, files, _chunk_list(model), sources)
    except ValueError as error:
        raise CheckpointError(f"{error}; resume with --no-load-optim") from None


def _parallel_sizes(layout: Any) -> dict[str, int]:
    if layout is None:
        return {}
    return {
        "tp": layout.tp,
        "pp": layout.pp,
        "cp": layout.cp,
        "vp": layout.virtual,
        "ep": layout.ep,
        "etp": layout.etp,
    }


def _shard_position(layout: Any) -> dict[str, int]:
    if layout is None:
        return {}
    return {
        "tp_rank": layout.tp_rank,
        "tp_size": layout.tp,
        "pp_rank": layout.pp_rank,
        "pp_size": layout.pp,
        # Megatron's `mp_rank_TT[_PPP]_EEE`: one file per expert-parallel rank
        "ep_rank": layout.ep_rank,
        "ep_size": layout.ep,
    }


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
    layout: Any = None,
    iteration: int | None = None,
) -> TrainState | None:
    """Load `load_dir`'s latest checkpoint (or `iteration`: `--ckpt-step`) into the
    objects; None if there is none.

    `--finetune`, or a `release` checkpoint (converted weights), loads the weights only
    and starts at iteration 0, as Megatron does.
    """
    if iteration is None and read_latest_iteration(load_dir) is None:
        return None
    position = _shard_position(layout)
    ckpt, iteration = load_checkpoint(
        load_dir,
        iteration,
        tp_rank=position.get("tp_rank", 0),
        pp_rank=position.get("pp_rank", 0),
        ep_rank=position.get("ep_rank", 0),
    )
    quantization = recorded_quantization(ckpt)
    if quantization is not None:
        raise CheckpointError(
            f"{load_dir} is a quantized checkpoint (mg-quantize, {quantization.recipe}): "
            "mg-train trains full-precision weights. --load the checkpoint it was quantized "
            "from, or evaluate / serve this one with mg-eval / mg-serve"
        )
    saved = (ckpt.get("mg") or {}).get("parallel") or {}
    if saved.get("ep", 1) != position.get("ep_size", 1):
        raise ValueError(
            f"{load_dir}: the torch-format checkpoint was saved with expert-model-parallel-size "
            f"{saved.get('ep', 1)}, this run uses {position.get('ep_size', 1)}; use the same "
            "size, or save with --ckpt-format torch_dist, which loads at any expert-parallel size"
        )
    saved_etp = saved.get("etp", saved.get("tp", 1))  # older saves: experts split as TP
    if layout is not None and saved.get("tp", 1) == layout.tp and saved_etp != layout.etp:
        raise ValueError(
            f"{load_dir}: the torch-format checkpoint was saved with "
            f"expert-tensor-parallel-size {saved_etp}, this run uses {layout.etp}; use the "
            "same size, or save with --ckpt-format torch_dist, which loads at any layout"
        )
    wanted = position.get("pp_size", 1)
    if saved.get("pp", 1) != wanted:
        raise ValueError(
            f"{load_dir}: the torch-format checkpoint was saved with pipeline-model-parallel-size "
            f"{saved.get('pp', 1)}, this run uses {wanted}; use the same size, or save with "
            "--ckpt-format torch_dist, which loads into any pipeline layout"
        )
    _load_model_states(model, ckpt, load_dir)
    weights_only = finetune or iteration == "release"
    if weights_only or not load_optim:
        refresh = getattr(optimizer, "reload_model_params", None)
        if refresh is not None:  # the distributed optimizer's main copies follow the weights
            refresh()
    if weights_only:
        return TrainState()
    if load_optim:
        if "optimizer" not in ckpt:
            raise ValueError(
                f"{load_dir}: the checkpoint has no optimizer state; resume with --no-load-optim"
            )
        _load_optimizer(optimizer, ckpt["optimizer"], model, load_dir, iteration, position)
        scheduler.load_state_dict(ckpt["opt_param_scheduler"])
        if "grad_scaler" in ckpt:
            loss_scaler.load_state_dict(ckpt["grad_scaler"])
    if load_rng:
        if "rng_state" not in ckpt:
            raise ValueError(f"{load_dir}: the checkpoint has no RNG state; use --no-load-rng")
        restore_tracker_states(set_rng_state(ckpt["rng_state"]))
    saved = ckpt.get("args")
    return TrainState(
        iteration=int(iteration) if iteration != "release" else 0,
        consumed_train_samples=int(getattr(saved, "consumed_train_samples", 0)),
        consumed_valid_samples=int(getattr(saved, "consumed_valid_samples", 0)),
        skipped_iterations=int(getattr(saved, "skipped_train_iterations", 0)),
        num_floating_point_operations_so_far=float(
            ckpt.get("num_floating_point_operations_so_far", 0.0)
        ),
    )
