"""Training checkpoints in Megatron's `torch_dist` format (`--ckpt-format torch_dist`).

The tensors go through `mg.core.checkpoint.dist_format` (torch.distributed.checkpoint),
every rank writing its own shards, so the checkpoint loads into any tensor-,
pipeline- or data-parallel layout. The key layout follows from the model's family
and configuration (`mg.core.checkpoint.formats.dist_layout`), never from its
parameter names: every family (a GPT, dense or MoE, with the local layer spec or
Transformer Engine's; a BERT; a T5; a hybrid Mamba) is stored as Megatron-Core stores
it (`mg.core.checkpoint.megatron_dist`: its `sharded_state_dict` keys, layers stacked
along a leading axis or keyed by number, routed experts on an expert axis under their
global numbers, a Mamba mixer's fused tensors in named row blocks, `_extra_state`
objects holding TE's modules' own), so Megatron-LM loads mg's weights and mg loads
Megatron-LM's. mg's earlier per-parameter layout (`model.<name>`) is read only: a
load reads either layout, told apart by the stored keys, so checkpoints saved that
way before still resume.

What carries over between mg and Megatron-LM, both ways: the weights, the iteration,
the consumed-sample counters (in `args`) and, in the same TP × PP layout, the random
generators (Megatron's `rng_state` ShardedObject, `rng_state/shard_<pp>.<tp>_<PP>.<TP>`,
one per (pipeline, tensor) position, the same dicts as `mg.core.checkpoint.rng`).
The optimizer does not: mg stores its state by our parameter names
(`optimizer.state.<name>.exp_avg`; with the distributed optimizer each rank's
fragments, as chunks of each parameter's global tensor), Megatron-Core by flat
buffer ranges of its distributed optimizer. So `mg-train --load` of a Megatron-LM
checkpoint needs `--no-load-optim` (or `--finetune`), and Megatron-LM loads mg's with
`--no-load-optim`; the learning-rate schedule then restarts from the flags.

Everything else is the `torch` format's content in `common.pt`: `args` (with the
consumed-sample counters), `iteration`, `opt_param_scheduler`, `grad_scaler`,
`num_floating_point_operations_so_far`, the `mg` configs and Megatron's
`content_metadata`. Checkpoints in mg's earlier layout keep their generators under
`rng.tp<T>_pp<P>.` and rank 0's in `common.pt`.

`--async-save` returns as soon as the state is copied to host memory; the
trainer waits for the previous save before the next one and before exiting.
"""

from __future__ import annotations

import pickle
import re
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
    load_common,
    load_dist_checkpoint,
    save_dist_checkpoint,
    stored_keys,
    stored_tensors,
)
from mg.core.checkpoint.formats import dist_layout
from mg.core.checkpoint.layout import CheckpointError
from mg.core.checkpoint.megatron_dist import (
    EXTRA_STATE,
    ModelState,
    checkpoint_is_megatron_layout,
    megatron_model_state,
    sharded_object,
)
from mg.core.checkpoint.megatron_sharded_keys import key_layout
from mg.core.checkpoint.te_extra_state import restore_extra_state
from mg.core.models.config import TransformerConfig
from mg.core.models.moe.expert_names import (
    global_expert_names,
    inverse,
    rename_keys,
    rename_optimizer_state,
)
from mg.core.models.rng_stream import restore_tracker_states, tracker_states
from mg.core.models.vision import LLaVAConfig
from mg.core.parallel.distributed_optimizer import DistributedOptimizer
from mg.core.parallel.expert_optimizer import ExpertParallelDistributedOptimizer
from mg.core.parallel.fully_sharded_optimizer import FullyShardedOptimizer
from mg.core.parallel.pipeline import global_parameter_name, global_view
from mg.core.parallel.row_blocks import ROW_BLOCKS, row_blocks
from mg.trainer import distributed
from mg.trainer.arguments.checkpointing import ASSUME_OK
from mg.trainer.checkpointing import TrainState, saved_args
from mg.trainer.ckpt_strictness import keys_to_skip
from mg.trainer.model_parallel import PipelineModel


def _named_globally(model: nn.Module) -> nn.Module:
    """A pipeline rank's chunks as one module with the whole model's parameter names, so
    the checkpoint's keys do not depend on the pipeline layout (it reshards across PP).
    Its state dict has the parameters and buffers only (no `_extra_state` entries)."""
    return global_view(model.chunks) if isinstance(model, PipelineModel) else model


_PLACEHOLDER = "<read from the checkpoint>"
# the distributed optimizer, also as the pair expert parallelism builds
_SHARDED = (DistributedOptimizer, ExpertParallelDistributedOptimizer)


def _model_config(model: nn.Module) -> TransformerConfig:
    """The GPT's config (a pipeline rank's chunks carry the whole model's)."""
    config = getattr(model, "config", None)
    if config is None and isinstance(model, nn.ModuleList) and len(model):
        config = getattr(model[0], "config", None)
    if not isinstance(config, (TransformerConfig, LLaVAConfig)):  # LLaVA: its towers'
        raise TypeError(f"{type(model).__name__} has no TransformerConfig")
    return config


def common_state(
    state: TrainState, args_flat: dict[str, Any], mg: dict[str, Any], schedule: Any = None
) -> dict[str, Any]:
    """A `torch_dist`-style folder's common.pt: Megatron's `args` with the resume counters,
    the checkpoint version, the FLOPs so far and mg's configs (`mg`); with `schedule`
    (scheduler, loss scaler) their states, as a save with the optimizer keeps them."""
    common: dict[str, Any] = {
        "args": saved_args(args_flat, state),
        "checkpoint_version": CHECKPOINT_VERSION,
        "num_floating_point_operations_so_far": state.num_floating_point_operations_so_far,
        "mg": mg,
    }
    if schedule is not None:
        scheduler, loss_scaler = schedule
        common["opt_param_scheduler"] = scheduler.state_dict()
        common["grad_scaler"] = loss_scaler.state_dict()
    return common


def _megatron_state(
    named: dict[str, Any], config: TransformerConfig, *, extra_state: bool = False
) -> ModelState:
    """`named` (experts under their global numbers) keyed as Megatron-Core keys `config`'s
    model (`key_layout`)."""
    return megatron_model_state(named, key_layout(config), extra_state=extra_state)


def _names(model: nn.Module, optimizer: DistributedOptimizer) -> list[str]:
    """The distributed optimizer's parameters by name, in its state's index order."""
    name_of = {id(p): name for name, p in model.named_parameters()}
    return [name_of[id(p)] for p in optimizer.params]


def _torch_optimizer(optimizer: Any) -> Any:
    """A fully sharded model's torch optimizer (inside `FullyShardedOptimizer`): its state
    is DTensor shards by parameter name, saved and loaded as any torch optimizer's."""
    return optimizer.optimizer if isinstance(optimizer, FullyShardedOptimizer) else optimizer


def _optimizer_state(model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name, as torch's `get_optimizer_state_dict`
    writes it (`state.<name>.exp_avg`, `param_groups.<i>.params` = names).

    The distributed optimizer's is this rank's own fragments (`sharded_state`), chunks
    of each parameter's global tensor: the data-parallel ranks together write every
    tensor once, nothing is gathered, and the checkpoint holds the same global tensors
    as the plain optimizer's, so it loads at any layout and into either optimizer."""
    if not isinstance(optimizer, _SHARDED):
        inner = _torch_optimizer(optimizer)
        return _with_row_blocks(model, get_optimizer_state_dict(model, inner))
    return _by_name(optimizer.sharded_state(), _names(model, optimizer))


def _state_dict(model: nn.Module, unwrapped: nn.Module) -> dict[str, Any]:
    """`model.state_dict()` (`model`: `unwrapped` named globally), whose tensors (detached
    copies of the parameters) keep the row blocks of a parameter sharded by them
    (`_with_row_blocks`), with every module's `_extra_state` (Transformer Engine's)
    under its whole-model name: a pipeline rank's global view holds tensors only."""
    named = model.state_dict()
    for name, param in model.named_parameters():
        blocks = row_blocks(param)
        if blocks is not None and name in named:
            setattr(named[name], ROW_BLOCKS, blocks)
    for key, module in _extra_state_modules(unwrapped).items():
        named.setdefault(key, module.get_extra_state())
    return named


def _extra_state_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The modules that keep an `_extra_state` (Transformer Engine's FP8 scaling state), by
    their whole-model state-dict key (a pipeline rank's chunks' under global names)."""
    pipeline = isinstance(model, PipelineModel)
    out: dict[str, nn.Module] = {}
    for chunk in model.chunks if pipeline else [model]:
        for name, module in chunk.named_modules():
            if type(module).get_extra_state is nn.Module.get_extra_state:
                continue
            key = f"{name}.{EXTRA_STATE}" if name else EXTRA_STATE
            key = global_parameter_name(chunk, key) if pipeline else key
            if key is not None:
                out[key] = module
    return out


def _with_row_blocks(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """Mark the state of a parameter sharded by row blocks (a Mamba mixer's in_proj and
    conv1d under TP, `mg.core.parallel.row_blocks`) as sharded the same way, so that it
    is stored as the whole tensor's rows, as the parameter is."""
    blocks = {name: row_blocks(p) for name, p in model.named_parameters() if row_blocks(p)}
    for name, entry in state.get("state", {}).items():
        if name in blocks:
            for value in entry.values():
                if isinstance(value, DTensor) and value.dim() > 0:
                    setattr(value, ROW_BLOCKS, blocks[name])
    return state


def _by_name(indexed: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """An optimizer state keyed by parameter index as one keyed by parameter name."""
    return {
        "state": {names[i]: entry for i, entry in indexed["state"].items()},
        "param_groups": [
            {**g, "params": [names[i] for i in g["params"]]} for g in indexed["param_groups"]
        ],
    }


def _optimizer_request(folder: Path, model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """What to read for the optimizer: this rank's own layout for a torch optimizer; for
    the distributed optimizer the regions of its own fragments (`sharded_state_to_load`),
    of whichever stored entries exist (a checkpoint of the plain optimizer has no
    main_param; one saved before the first step has no state)."""
    if not isinstance(optimizer, _SHARDED):
        inner = _torch_optimizer(optimizer)
        return _with_row_blocks(model, get_optimizer_state_dict(model, inner))
    local = _names(model, optimizer)
    experts = global_expert_names(model)  # the stored names of this rank's experts
    names = [experts.get(name, name) for name in local]
    stored = stored_keys(folder, "optimizer.state.")
    request = optimizer.sharded_state_to_load(
        lambda i, key: f"optimizer.state.{names[i]}.{key}" in stored
    )
    # Non-tensor entries are read whole in place of these placeholders (None is skipped).
    model_groups = optimizer.param_groups[: len(optimizer.group_members())]
    groups = [{k: _PLACEHOLDER for k in g} for g in model_groups]
    return {"state": _by_name(request, local)["state"], "param_groups": groups}


def _with_members(groups: list[dict], members: list[list], load_dir: str) -> list[dict]:
    """The stored groups' options with this rank's parameters as members: a group's stored
    names are one pipeline stage's (DCP keeps one copy of a non-tensor entry)."""
    if len(groups) != len(members):
        raise ValueError(
            f"{load_dir}: the checkpoint's optimizer has {len(groups)} parameter groups, this "
            f"model's has {len(members)}; was it saved for a different model or optimizer?"
        )
    return [{**g, "params": m} for g, m in zip(groups, members, strict=True)]


# How this run's optimizer computes, not what it learned: kept from the running optimizer
# (a distributed-optimizer checkpoint stores fused=True; a TP run's plain AdamW over
# DTensors needs foreach=False).
_IMPLEMENTATION_OPTIONS = ("fused", "foreach", "capturable", "differentiable")


def _load_optimizer(
    model: nn.Module, optimizer: Any, loaded: dict[str, Any], load_dir: str
) -> None:
    if not isinstance(optimizer, _SHARDED):
        optimizer = _torch_optimizer(optimizer)
        ours = [g["params"] for g in get_optimizer_state_dict(model, optimizer)["param_groups"]]
        groups = _with_members(loaded["param_groups"], ours, load_dir)
        for group, current in zip(groups, optimizer.param_groups, strict=True):
            group.update({k: current[k] for k in _IMPLEMENTATION_OPTIONS if k in current})
        loaded["param_groups"] = groups
        set_optimizer_state_dict(model, optimizer, loaded)
        return
    index = {name: i for i, name in enumerate(_names(model, optimizer))}
    groups = _with_members(loaded["param_groups"], optimizer.group_members(), load_dir)
    state = {index[name]: entry for name, entry in loaded["state"].items()}
    optimizer.load_sharded_state({"state": state, "param_groups": groups})


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

    `rng_shard` names this rank's (tensor, pipeline) position: its generators, which
    differ between those positions (the default ones per pipeline stage, the
    tensor-parallel dropout stream per tensor rank), are stored under it."""
    unwrapped = distributed.unwrap(model)
    model = _named_globally(unwrapped)
    if isinstance(optimizer, _SHARDED):
        optimizer.finish_param_sync()  # the model's weights are complete only after this
    named = _state_dict(model, unwrapped)
    experts = global_expert_names(model)  # expert parallelism: experts by global number
    config = _model_config(unwrapped)
    dist_layout(args_flat["model_family"], config)  # Megatron-Core's, for every family
    model_state = _megatron_state(rename_keys(named, experts), config, extra_state=True)
    sharded: dict[str, Any] = {**model_state.tensors, **model_state.objects}
    if save_optim:
        sharded["optimizer"] = rename_optimizer_state(_optimizer_state(model, optimizer), experts)
    common = common_state(
        state, args_flat, mg_metadata(model_config, tokenizer_config, **parallel),
        (scheduler, loss_scaler) if save_optim else None,
    )  # fmt: skip
    common["content_metadata"] = {"singleton_local_shards": False}
    if save_rng and rng_shard is not None:
        # Megatron's: one object per (pipeline, tensor) position, shared by its DP ranks.
        sizes = (int(parallel.get("pp", 1)), int(parallel.get("tp", 1)))
        key = rng_state_key(_position(rng_shard), sizes)
        sharded[key] = sharded_object([get_rng_state(tracker_states())])  # rng_state_list
    elif save_rng:  # no position given: rank 0's, where Megatron's torch format keeps it
        common["rng_state"] = [get_rng_state()]
    return save_dist_checkpoint(save_dir, state.iteration, sharded, common, async_save=async_save)


_RNG_STATE = "rng_state"  # beside the tracker streams under rng.tp<T>_pp<P>.
_POSITION = re.compile(r"^tp(\d+)_pp(\d+)$")


def _position(rng_shard: str) -> tuple[int, int]:
    """(pipeline rank, tensor rank) of a `tp<T>_pp<P>` position name."""
    match = _POSITION.match(rng_shard)
    if match is None:
        raise ValueError(f"not a tp<T>_pp<P> position: {rng_shard!r}")
    return int(match.group(2)), int(match.group(1))


def rng_state_key(position: tuple[int, int], sizes: tuple[int, int]) -> str:
    """Megatron-LM's DCP key of a (pipeline, tensor) position's `rng_state` ShardedObject
    (`get_rng_state`: shape (PP, TP), offset (pp, tp))."""
    (pp, tp), (pp_size, tp_size) = position, sizes
    return f"rng_state/shard_{pp}.{tp}_{pp_size}.{tp_size}"


def _megatron_rng_request(folder: Path, rng_shard: str) -> tuple[str | None, bool]:
    """The stored `rng_state` object to read and whether it is this rank's position's
    (else the first position's, whose default generators a resume in another layout
    takes, as it takes rank 0's from an older checkpoint); None when none is stored."""
    pp, tp = _position(rng_shard)
    stored = sorted(stored_keys(folder, "rng_state/shard_"))
    own = [k for k in stored if k.split("_")[2] == f"{pp}.{tp}"] if stored else []
    sizes = {k.rsplit("_", 1)[1] for k in stored}
    if own and len(sizes) == 1:
        return own[0], True
    first = [k for k in stored if k.split("_")[2] == "0.0"]
    return (first[0], False) if first else (None, False)


def _position_rng_request(folder: Path, position: str) -> dict[str, Any]:
    """What to read of a position's generators: whatever the checkpoint holds for it
    (nothing if it was saved in another layout or before per-position states)."""
    prefix = f"rng.{position}."
    request: dict[str, Any] = {
        k[len(prefix) :]: v for k, v in stored_tensors(folder, prefix).items()
    }
    if prefix + _RNG_STATE in stored_keys(folder, prefix):
        request[_RNG_STATE] = b""  # an object: replaced by the stored one
    return request


def _restore_rng(common_state: Any, position: dict[str, Any]) -> None:
    """The position's default generators if stored, else the common (rank 0's) ones;
    then the tensor-parallel streams stored for the position."""
    own = position.get(_RNG_STATE)
    set_rng_state(pickle.loads(own) if own else common_state)
    restore_tracker_states({k: v for k, v in position.items() if k != _RNG_STATE})


def _restore_extra_states(
    model: nn.Module, state: ModelState, loaded: dict[str, Any], folder: Path
) -> None:
    """Hand each module its loaded `_extra_state` (Transformer Engine's FP8 scaling state),
    as `load_state_dict` would; one stored as None (a local-spec save) is left alone."""
    modules = _extra_state_modules(model)
    for key, name in state.extra_states.items():
        if key not in loaded:
            continue
        (data,) = loaded[key]  # the ShardedObject's data
        restore_extra_state(modules[name], data, str(folder))


def _foreign_optimizer_refusal(folder: Path, common: dict[str, Any]) -> str:
    """Megatron-LM's optimizer state is not read here; a save without any is said to be so."""
    if "optimizer" not in common and not stored_keys(folder, "optimizer"):
        return (
            f"{folder} holds no optimizer state (saved by Megatron-LM or megatron-core without "
            "it, e.g. with --no-save-optim); resume with --no-load-optim (weights, iteration "
            "and consumed samples carry over) or --finetune"
        )
    return (
        f"{folder} was saved by Megatron-LM, whose optimizer state (its distributed "
        "optimizer's buffers) mg does not read; load it with --no-load-optim (weights, "
        "iteration and consumed samples carry over) or --finetune"
    )


def _saved_iteration(common: dict[str, Any], folder: Path, iteration: Any) -> int:
    """common.pt's iteration; a bare `dist_checkpointing.save` (no Megatron-LM args) records
    none, so the folder's name gives it, said in one line."""
    if "iteration" in common:
        return int(common["iteration"])
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(
            f" note: {folder}/common.pt records no iteration (a bare dist_checkpointing.save, "
            f"without Megatron-LM's args): resuming at iteration {iteration} from the folder's "
            "name, consumed samples from 0",
            flush=True,
        )
    return int(iteration)


def _apply_strictness(
    strictness: str, sharded: dict[str, Any], folder: Path, megatron: bool
) -> None:
    """Leave out of `sharded`'s model request the keys the checkpoint lacks, as
    `strictness` says (or raise, naming them)."""
    stored = {
        key
        for key in stored_keys(folder)
        if EXTRA_STATE not in key and not key.startswith(("optimizer", "rng"))
    }
    if megatron:
        requested = {k for k, v in sharded.items() if isinstance(v, torch.Tensor)}
        for key in keys_to_skip(strictness, requested, stored, str(folder)):
            del sharded[key]
        return
    model = sharded["model"]
    requested = {f"model.{k}" for k in model if EXTRA_STATE not in k}
    stored = {k for k in stored if k.startswith("model.")}
    for key in keys_to_skip(strictness, requested, stored, str(folder)):
        del model[key.removeprefix("model.")]


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
    iteration: int | None = None,
    strictness: str = ASSUME_OK,
) -> TrainState:
    """Load the latest torch_dist checkpoint into this rank's (possibly sharded) objects
    (`rng_shard`: as for `save`; a stream saved in another layout is not restored;
    `strictness`: `--dist-ckpt-strictness`, `mg.trainer.ckpt_strictness`)."""
    unwrapped = distributed.unwrap(model)
    model = _named_globally(unwrapped)
    iteration = read_latest_iteration(load_dir) if iteration is None else iteration
    folder = Path(checkpoint_dir(load_dir, iteration))
    # A `release` checkpoint (converted weights) loads like --finetune, as in Megatron.
    finetune = finetune or iteration == RELEASE
    want_optim = load_optim and not finetune
    # DCP unpickles the folder's objects (rng_state) anyway: its common.pt is read alike
    # (Megatron-LM pickles enums in its args)
    common = load_common(folder, allow_pickle=True)
    foreign = "mg" not in common  # saved by Megatron-LM
    if foreign and want_optim:
        raise CheckpointError(_foreign_optimizer_refusal(folder, common))
    megatron = checkpoint_is_megatron_layout(folder)
    named = _state_dict(model, unwrapped)
    experts = global_expert_names(model)  # expert parallelism: experts by global number
    model_state = None
    if megatron:
        model_state = _megatron_state(rename_keys(named, experts), _model_config(unwrapped))
        sharded: dict[str, Any] = dict(model_state.tensors)
        stored = stored_keys(folder)
        for key in model_state.extra_states:  # TE's modules': objects, read as stored
            if key in stored:
                sharded[key] = b""  # an object: replaced by the stored one
    else:
        sharded = {"model": rename_keys(named, experts)}
    if strictness != ASSUME_OK:
        _apply_strictness(strictness, sharded, folder, megatron)
    if want_optim:
        request = _optimizer_request(folder, model, optimizer)
        sharded["optimizer"] = rename_optimizer_state(request, experts)
    rng_key, own_rng = None, False
    if load_rng and not finetune and rng_shard is not None:
        if megatron:
            rng_key, own_rng = _megatron_rng_request(folder, rng_shard)
            if rng_key is not None:
                sharded[rng_key] = b""  # an object: replaced by the stored one
        else:
            sharded["rng"] = {rng_shard: _position_rng_request(folder, rng_shard)}
    common = load_dist_checkpoint(folder, sharded, allow_pickle=True)
    if model_state is not None:
        model_state.finish_load()
        _restore_extra_states(unwrapped, model_state, sharded, folder)
    if want_optim:
        loaded = rename_optimizer_state(sharded["optimizer"], inverse(experts))
        _load_optimizer(model, optimizer, loaded, load_dir)
        scheduler.load_state_dict(common["opt_param_scheduler"])
        if "grad_scaler" in common:
            loss_scaler.load_state_dict(common["grad_scaler"])
    elif isinstance(optimizer, _SHARDED):
        optimizer.reload_model_params()  # its main copies must follow the loaded weights
    if finetune:
        return TrainState()
    if load_rng and rng_key is not None:
        (data,) = sharded[rng_key]  # the ShardedObject's data: Megatron's rng_state_list
        tracker = set_rng_state(data)
        if own_rng:  # the tensor-parallel streams of this very position
            restore_tracker_states(tracker)
    elif load_rng:
        if "rng_state" not in common:
            raise ValueError(f"{load_dir}: the checkpoint has no RNG state; use --no-load-rng")
        _restore_rng(common["rng_state"], sharded.get("rng", {}).get(rng_shard, {}))
    saved = common.get("args")
    return TrainState(
        iteration=_saved_iteration(common, folder, iteration),
        consumed_train_samples=int(getattr(saved, "consumed_train_samples", 0)),
        consumed_valid_samples=int(getattr(saved, "consumed_valid_samples", 0)),
        skipped_iterations=int(getattr(saved, "skipped_train_iterations", 0)),
        num_floating_point_operations_so_far=float(
            common.get("num_floating_point_operations_so_far", 0.0)
        ),
    )
