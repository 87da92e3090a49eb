"""Megatron's `--moe-use-upcycling`: the first run of an MoE model starts from a dense one.

Sparse upcycling (Komatsuzaki et al. 2022; Megatron-Core's `upcycling_utils`): the
dense checkpoint in `--load` is read into a dense twin of the MoE model (same flags,
no experts, same parallel layout), and every weight the two share is copied; each
MoE layer's experts become copies of that layer's dense MLP and its router keeps
its fresh initialisation (shared experts too, as in Megatron). With a softmax
router normalised over its top-k the weights of a token's experts sum to one, so
the upcycled model computes the dense model's function at its first step.

As in Megatron-LM the upcycled model is saved to `--save` at iteration 1 before
training goes on, with the dense run's consumed samples and floating-point
operations; the optimizer, its schedule and the RNG start afresh (Megatron turns
on --no-load-optim and --no-load-rng). A `--save` that already holds a checkpoint
is refused: later runs resume from it without the flag.
"""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from mg.core.checkpoint import CheckpointError, describe, read_latest_iteration
from mg.core.checkpoint.formats import TORCH_DIST
from mg.core.models import TransformerConfig
from mg.trainer import checkpoint_io, checkpointing, checkpointing_dist, distributed
from mg.trainer.arguments import ArgumentError
from mg.trainer.checkpointing import TrainState
from mg.trainer.model_parallel import PipelineModel

UPCYCLED_ITERATION = 1
"""Megatron saves the upcycled model as iteration 1 and trains on from there."""

# an expert's weight -> the dense MLP's it copies: sequential, then grouped-GEMM names
_EXPERT_NAMES = (
    re.compile(r"^(.*\.mlp)\.experts\.local_experts\.\d+\.(linear_fc[12])\.(weight|bias)$"),
    re.compile(r"^(.*\.mlp)\.experts\.(linear_fc[12])\.(weight|bias)\d+$"),
)
# an MoE layer's own pre-MLP norm <- the dense layer's norm fused into linear_fc1 (TE spec)
_FUSED_NORM = re.compile(r"^(.*)\.pre_mlp_layernorm\.(weight|bias)$")


def check_sources(load: str | None, save: str | None, iteration: int | None = None) -> None:
    """Refuse, naming the flag, what cannot be upcycled: no checkpoint in `--load`, one
    that is already an MoE, or a `--save` that already holds a checkpoint."""
    if save and read_latest_iteration(save) is not None:
        raise ArgumentError(
            f"--moe-use-upcycling: --save {save} already holds a checkpoint; upcycling is for "
            "the first run only, resume from it with --load and without --moe-use-upcycling"
        )
    if not load or (iteration is None and read_latest_iteration(load) is None):
        raise ArgumentError(
            f"--moe-use-upcycling: no checkpoint in --load {load} to upcycle "
            "(no latest_checkpointed_iteration.txt)"
        )
    try:
        info = describe(load, iteration, allow_pickle=True)
    except (CheckpointError, OSError) as error:
        raise ArgumentError(f"--moe-use-upcycling: --load {load}: {error}") from None
    experts = (info.model_config or {}).get("num_moe_experts")
    if experts:
        raise ArgumentError(
            f"--moe-use-upcycling: --load {load} is already an MoE checkpoint ({experts} "
            "experts); upcycle a dense checkpoint, or resume this one without the flag"
        )


def dense_config(config: TransformerConfig) -> TransformerConfig:
    """The MoE config's dense twin: every layer an MLP of the experts' width."""
    if config.moe_ffn_hidden_size != config.ffn_hidden_size:
        raise ArgumentError(
            f"--moe-use-upcycling: --moe-ffn-hidden-size ({config.moe_ffn_hidden_size}) must "
            f"equal the dense MLP's width ({config.ffn_hidden_size}), as each expert starts as "
            "a copy of it; drop --moe-ffn-hidden-size"
        )
    data = config.to_dict() | {"num_moe_experts": None, "moe_ffn_hidden_size": None}
    return TransformerConfig.from_dict(data)


def load_dense(load: str, dense: nn.Module, layout: Any, iteration: int | None) -> TrainState:
    """The dense checkpoint's weights into `dense` (this rank's shards, either format) and
    its counters. A dense torch-format checkpoint has one file per (tp, pp) rank: every
    expert-parallel rank reads the one of its position."""
    what: dict[str, Any] = {
        "model": dense,
        "optimizer": None,
        "scheduler": None,
        "loss_scaler": None,
        "load_optim": False,
        "load_rng": False,
        "iteration": iteration,
    }
    if checkpoint_io.saved_format(load, iteration) == TORCH_DIST:
        return checkpointing_dist.resume(load, **what)
    position = SimpleNamespace(
        tp_rank=layout.tp_rank, tp=layout.tp, pp_rank=layout.pp_rank, pp=layout.pp, ep_rank=0, ep=1
    )
    state = checkpointing.resume(load, **what, layout=position)
    if state is None:
        raise CheckpointError(f"--moe-use-upcycling: no checkpoint in --load {load}")
    return state


def dense_source(name: str, dense_names: set[str]) -> str | None:
    """The dense parameter an MoE model's parameter starts from, or None (router, shared
    experts, expert bias: they keep their initialisation)."""
    if name in dense_names:
        return name
    for pattern in _EXPERT_NAMES:
        match = pattern.match(name)
        if match:
            source = "{}.{}.{}".format(*match.groups())
            return source if source in dense_names else None
    match = _FUSED_NORM.match(name)
    if match:
        source = f"{match.group(1)}.mlp.linear_fc1.layer_norm_{match.group(2)}"
        return source if source in dense_names else None
    return None


@torch.no_grad()
def _copy(target: torch.Tensor, source: torch.Tensor) -> None:
    """`source`'s values into `target`, each in its own layout: shard to shard when both
    are laid out alike (a dense MLP and its experts under tensor parallelism), else
    through the whole tensor (experts kept whole, expert-tensor-parallel size 1)."""
    alike = isinstance(source, DTensor) and isinstance(target, DTensor)
    if alike and (source.placements, source.shape) == (target.placements, target.shape):
        target.to_local().copy_(source.to_local())
        return
    whole = source.full_tensor() if isinstance(source, DTensor) else source
    if isinstance(target, DTensor):
        whole = distribute_tensor(whole, target.device_mesh, target.placements).to_local()
        target.to_local().copy_(whole)
    else:
        target.copy_(whole)


def _chunks(model: nn.Module) -> list[nn.Module]:
    model = distributed.unwrap(model)
    return list(model) if isinstance(model, PipelineModel) else [model]


def copy_dense_into_moe(moe: nn.Module, dense: nn.Module) -> list[str]:
    """Initialise the MoE model from its dense twin (pipeline chunk by chunk, each rank its
    own shards and experts); returns the MoE model's names left as initialised."""
    kept = []
    for moe_chunk, dense_chunk in zip(_chunks(moe), _chunks(dense), strict=True):
        sources = dense_chunk.state_dict(keep_vars=True)
        names = set(sources)
        for name, target in moe_chunk.state_dict(keep_vars=True).items():
            source = dense_source(name, names)
            if source is None:
                kept.append(name)
            else:
                _copy(target, sources[source])
    return kept


def upcycle(
    load: str, moe: nn.Module, dense: nn.Module, layout: Any, iteration: int | None = None
) -> TrainState:
    """Read `load` into `dense`, copy it into `moe`; the state the upcycled run starts at."""
    dense_state = load_dense(load, dense, layout, iteration)
    copy_dense_into_moe(moe, dense)
    return TrainState(
        iteration=UPCYCLED_ITERATION,
        consumed_train_samples=dense_state.consumed_train_samples,
        consumed_valid_samples=dense_state.consumed_valid_samples,
        num_floating_point_operations_so_far=dense_state.num_floating_point_operations_so_far,
    )
