"""Shard-aware construction: a rank allocates only the parameters it owns.

The model is built on the meta device, parallelised there (tensor parallelism
turns parameters into DTensors with meta local shards, the pipeline split keeps
this rank's layers), and then `materialize` gives storage to what is left:

    with torch.device("meta"):
        model = GPTModel(config)
    apply_tensor_parallel(model, tp_mesh, sp, device=device)
    chunks = split_model(model, pp_rank, pp)
    materialize(chunks, config, device)

Initialisation equals the single-process model's (`torch.manual_seed(seed);
GPTModel(config)`): the model's `init_units()` are replayed in order, each on
a full-size scratch copy of one unit (the embedding, one layer, the final norm,
the output layer) that draws the same random numbers as the single-process
build; this rank copies its slice of each tensor it owns and the scratch copy
is dropped. The transient peak is one unit, not the model; the cost is that
every rank draws the whole model's random numbers (Megatron's
`--use-cpu-initialization` path does the same per layer).

`perform_initialization=False` (Megatron's `--no-initialization`) only
allocates: for runs that load their weights from a checkpoint.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from mg.core.models.config import TransformerConfig
from mg.core.models.mamba import decoder_model
from mg.core.parallel.pipeline import PipelineChunk, global_parameter_name
from mg.core.parallel.row_blocks import local_rows, row_blocks

_TIED = "embedding.word_embeddings.weight"


def owned_tensors(parts: Sequence[nn.Module]) -> dict[str, list[Tensor]]:
    """This rank's parameters and buffers by the whole model's names.

    `parts` is a whole model or this rank's pipeline chunks; the last stage's
    copy of a tied embedding is listed under the embedding's name (it starts
    as a copy of it)."""
    owned: dict[str, list[Tensor]] = {}
    for part in parts:
        tensors = dict(part.named_parameters(remove_duplicate=False))
        tensors.update(dict(part.named_buffers(remove_duplicate=False)))
        for local, tensor in tensors.items():
            name = local
            if isinstance(part, PipelineChunk):
                name = global_parameter_name(part, local) or _TIED
            owned.setdefault(name, []).append(tensor)
    return owned


@torch.no_grad()
def materialize(
    parts: Sequence[nn.Module],
    config: TransformerConfig,
    device: torch.device,
    *,
    init_device: torch.device | None = None,
    perform_initialization: bool = True,
) -> None:
    """Give storage on `device` to the meta tensors of `parts` and initialise them.

    `init_device` is where the full-size units are drawn (CPU by default, which
    makes the values independent of the accelerator; the caller seeds its
    generator first). Tensors already materialised are left alone."""
    for part in parts:
        _to_empty_keeping_marks(part, device)
    if not perform_initialization:
        return
    owned = owned_tensors(parts)
    init_device = init_device or torch.device("cpu")
    with torch.device("meta"):
        reference = decoder_model(config)  # a GPTModel, or a MambaModel for a MambaConfig
    for unit in reference.init_units():
        unit.module.to_empty(device=init_device)
        unit.init(unit.module)
        full = dict(unit.module.named_parameters(prefix=unit.prefix))
        full.update(dict(unit.module.named_buffers(prefix=unit.prefix)))
        for name, value in full.items():
            for target in owned.pop(name, []):
                copy_shard(target, value)
        unit.module.to_empty(device="meta")  # drop the scratch copy
    if owned:
        raise RuntimeError(
            f"materialize: no init unit covers {sorted(owned)}; add them to init_units()"
        )


def _to_empty_keeping_marks(module: nn.Module, device: torch.device) -> None:
    """`module.to_empty(device)`, keeping the attributes set on its parameters (to_empty
    makes new Parameter objects; the pipeline marks the tied copy with one)."""
    marks = {name: dict(p.__dict__) for name, p in module.named_parameters()}
    module.to_empty(device=device)
    for name, param in module.named_parameters():
        param.__dict__.update(marks.get(name, {}))


def to_keeping_marks(module: nn.Module, device: torch.device) -> None:
    """`module.to(device)`, keeping the attributes set on its parameters: DTensor
    parameters are swapped for new objects on the way, even on the same device."""
    marks = {name: dict(p.__dict__) for name, p in module.named_parameters()}
    module.to(device)
    for name, param in module.named_parameters():
        param.__dict__.update(marks.get(name, {}))


def copy_shard(target: Tensor, full: Tensor) -> None:
    """Copy this rank's slice of the whole tensor `full` into `target` (a DTensor
    parameter's local shard, or a plain tensor)."""
    blocks = row_blocks(target)
    if blocks is not None:  # a slice of each row block (a Mamba mixer's in_proj, conv1d)
        mesh = target.device_mesh
        piece = local_rows(full.to(target.device), blocks, mesh.size(), mesh.get_local_rank())
        target._local_tensor.copy_(piece)
    elif isinstance(target, DTensor):
        piece = distribute_tensor(
            full.to(target.device), target.device_mesh, target.placements, src_data_rank=None
        ).to_local()
        target._local_tensor.copy_(piece)
    else:
        target.copy_(full)
