"""Tensor parallelism for a RetroModel (mg.core.models.retro), Megatron's layout.

The GPT layers of the decoder and of the neighbour encoder are sharded as any GPT
layer (`tensor_parallel._parallelize_layer`); the Retro layers have the same
self-attention and MLP plan, and their cross-attention (`cross_attention.attn`, the
decoder's chunked one and the encoder's first layer's) is sharded as T5's: linear_q
and linear_kv column-parallel by heads (linear_kv's rows are [k; v] per head, so a
dim-0 shard holds whole heads), linear_proj row-parallel with its output all-reduced.
The embedding (shared by the tokens and the neighbours) is vocab-parallel and the
loss vocab-parallel, as GPT's. Sequence parallelism is not implemented for Retro:
the chunk regrouping would need the whole sequence on every rank.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)

from mg.core.models.retro import RetroDecoderLayer, RetroEncoderLayer, RetroModel
from mg.core.parallel.loss_parallel import VocabParallelOutputHead
from mg.core.parallel.row_parallel import RowParallelLinear
from mg.core.parallel.tensor_parallel import (
    GatedColwiseParallel,
    TensorParallelError,
    _fork_tensor_parallel_dropout,
    _parallelize_layer,
    _use_local_head_counts,
    _use_local_head_counts_of_core,
    check_tensor_parallel_sizes,
)


def apply_retro_tensor_parallel(
    model: RetroModel,
    tp_mesh: DeviceMesh,
    sequence_parallel: bool,
    seed: int | None = None,
    device: torch.device | None = None,
    **_: object,
) -> None:
    """Shard `model` in place over the 1-D `tp_mesh` (every TP rank calls this); the
    arguments are `apply_tensor_parallel`'s (its expert options do not apply)."""
    if sequence_parallel:
        raise TensorParallelError(
            "--sequence-parallel: not implemented for Retro (its chunked cross-attention "
            "regroups the whole sequence); leave it out"
        )
    tp = tp_mesh.size()
    check_tensor_parallel_sizes(model.config, tp)
    parallelize_module(
        model.embedding.word_embeddings,
        tp_mesh,
        RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        src_data_rank=None,
    )
    layers = list(model.decoder.layers)
    for layer in model.decoder.layers:
        encoder = getattr(layer.cross_attention, "encoder", None) if _is_retro(layer) else None
        if encoder is not None:
            layers += list(encoder.layers)
    retro = [layer for layer in layers if _is_retro(layer)]
    # attention dropout over this rank's heads from the per-rank stream: the self-attention
    # of every layer and each Retro cross-attention (given as holders of a core attention)
    holders = [layer for layer in layers if not _is_retro(layer)]
    holders += [SimpleNamespace(self_attention=layer.self_attention) for layer in retro]
    holders += [SimpleNamespace(self_attention=layer.cross_attention.attn) for layer in retro]
    _fork_tensor_parallel_dropout(model, holders, tp_mesh, False, seed, device)
    for layer in layers:
        if _is_retro(layer):
            _parallelize_retro_layer(layer, tp_mesh)
        else:
            _parallelize_layer(layer, tp_mesh, Replicate(), False)
    if isinstance(model.output_layer, nn.Linear):
        parallelize_module(model.output_layer, tp_mesh, ColwiseParallel(), src_data_rank=None)
    model.output_head = VocabParallelOutputHead(tp_mesh)
    model.tensor_parallel_size = tp
    model.sequence_parallel = False


def _is_retro(layer: nn.Module) -> bool:
    return isinstance(layer, RetroDecoderLayer | RetroEncoderLayer)


def _parallelize_retro_layer(layer: nn.Module, tp_mesh: DeviceMesh) -> None:
    """A GPT layer's plan (no sequence parallelism) plus the cross-attention's."""
    whole = Replicate()
    plan: dict[str, object] = {
        "self_attention": PrepareModuleInput(
            input_layouts=(whole, None, None), desired_input_layouts=(whole, None, None)
        ),
        "self_attention.linear_qkv": ColwiseParallel(),
        "self_attention.linear_proj": RowParallelLinear(output_layouts=whole),
        "mlp": PrepareModuleInput(input_layouts=(whole,), desired_input_layouts=(whole,)),
        "mlp.linear_fc1": GatedColwiseParallel() if layer.mlp.gated else ColwiseParallel(),
        "mlp.linear_fc2": RowParallelLinear(output_layouts=whole),
        "cross_attention.attn": PrepareModuleInput(
            input_layouts=(whole, whole, None), desired_input_layouts=(whole, whole, None)
        ),
        "cross_attention.attn.linear_q": ColwiseParallel(),
        "cross_attention.attn.linear_kv": ColwiseParallel(),  # rows grouped per head
        "cross_attention.attn.linear_proj": RowParallelLinear(output_layouts=whole),
    }
    parallelize_module(layer, tp_mesh, plan, src_data_rank=None)
    tp = tp_mesh.size()
    _use_local_head_counts(layer.self_attention, tp)
    attn = layer.cross_attention.attn
    attn.num_heads //= tp
    _use_local_head_counts_of_core(attn.core_attention, tp)
