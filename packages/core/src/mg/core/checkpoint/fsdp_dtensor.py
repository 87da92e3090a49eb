"""`--ckpt-format fsdp_dtensor`: a model and its optimizer as PyTorch's state-dict API sees them.

    <save>/iter_0000200/  a torch_dist folder (`dist_format`: DCP shards, common.pt,
                          metadata.json written last), whose common.pt says
                          checkpoint_format = fsdp_dtensor

The tensors are `torch.distributed.checkpoint.state_dict`'s: `model.<name>` for each
parameter and buffer, `optimizer.state.<name>.<exp_avg|exp_avg_sq|step>` and
`optimizer.param_groups`, keyed by the parameters' names whatever wraps them. Under
FSDP they are DTensors: every rank writes its own shards, DCP records each tensor's
global shape, and no rank gathers the whole model. A load asks for this run's
tensors, sharded or whole, and DCP reads the chunks that overlap them: the same
checkpoint loads at another data-parallel size, or into a run without FSDP.
(The keys are mg's per-parameter `torch_dist` ones, so readers of that layout read
the weights too.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from mg.core.checkpoint.dist_format import COMMON_FILENAME, is_torch_dist
from mg.core.checkpoint.global_chunks import GlobalChunks, own_storage
from mg.core.checkpoint.serialization import load_file

FSDP_DTENSOR = "fsdp_dtensor"
FORMAT_KEY = "checkpoint_format"
"""The common.pt entry that tells this format from a plain torch_dist folder."""


def is_fsdp_dtensor(folder: str | Path) -> bool:
    """True for a complete fsdp_dtensor iteration folder."""
    if not is_torch_dist(folder):
        return False
    common = load_file(Path(folder) / COMMON_FILENAME, allow_pickle=True)
    return common.get(FORMAT_KEY) == FSDP_DTENSOR


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """This rank's model (and optimizer) tensors, keyed as the module docstring says: what
    a save writes, and what a load fills (collective under FSDP)."""
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer is not None:  # a fresh optimizer's state is created (zeros) to be filled
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    return state


def writable(state: Any) -> Any:
    """What DCP is handed for `state`: each FSDP × TP shard (strided over a 2-D mesh) as
    the one block of the global tensor it is, at its offsets (`GlobalChunks` of a view,
    so a load fills the shard); everything else as it is."""
    if isinstance(state, dict):
        return {k: writable(v) for k, v in state.items()}
    if not (
        isinstance(state, DTensor)
        and state.device_mesh.ndim > 1
        and any(isinstance(p, _StridedShard) for p in state.placements)
    ):
        return state
    local = state.to_local()
    shape, offset = compute_local_shape_and_global_offset(
        state.shape, state.device_mesh, state.placements
    )
    if tuple(shape) != tuple(local.shape):
        raise NotImplementedError(f"a {state.placements} shard is not one block of its tensor")
    return GlobalChunks(state.shape, [(own_storage(local), tuple(offset))])


def copy_objects(loaded: Any, state: Any) -> None:
    """The non-tensor values (optimizer options) a load put in `writable(state)`'s copy,
    back into `state` (tensors were filled in place)."""
    for key, value in loaded.items():
        if isinstance(value, dict) and isinstance(state.get(key), dict):
            copy_objects(value, state[key])
        elif not isinstance(value, torch.Tensor):
            state[key] = value


def load_sharded_state(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, state: dict[str, Any]
) -> None:
    """Put what a load filled (`sharded_state`'s dict) into the model and optimizer."""
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=True))
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
