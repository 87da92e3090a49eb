"""Tensor parallelism for a RetroModel (mg.core.models.retro), Megatron's layout.

The GPT layers of the decoder and of the neighbour encoder are sharded as any GPT
layer (`tensor_parallel._parallelize_layer`); the Retro layers have the same
self-attention and MLP plan, and their cross-attention (`cross_attention.attn`, the
decoder's chunked one and the encoder's first layer's) is sharded as T5's: linear_q
and linear_kv column-parallel by heads (linear_kv's rows are [k; v] per head, so a
dim-0 shard holds whole heads), linear_proj row-parallel with its output all-reduced.
The embedding (shared by the tokens and the neighbours) is vocab-parallel and the
loss vocab-parallel, as GPT's.

With sequence parallelism the decoder's layers work on sequence slices as GPT's do:
the token embeddings are cut into the ranks' slices at the decoder's input (the
neighbours' embeddings stay whole), the norms run on slices, the self-attention and
the MLP gather the sequence before their column-parallel linears and reduce-scatter
after their row-parallel ones. A Retro layer's chunked cross-attention regroups the
whole sequence into chunks, so its normed input is gathered over the TP ranks before
it, and its output (all-reduced, dropped out, back in sequence order) is cut into the
rank's slice after it, before the residual add. The neighbour encoder inside it sees
whole inputs and is sharded as without sequence parallelism (as the VLM's towers).
The decoder's output, the rank's slice, is gathered by the vocab-parallel loss. The
sequence length must be a multiple of the TP size.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from mg.core.models.retro import RetroDecoderLayer, RetroEncoderLayer, RetroModel
from mg.core.models.rng_stream import model_parallel_stream
from mg.core.models.subclass import extend_class
from mg.core.parallel.loss_parallel import VocabParallelOutputHead
from mg.core.parallel.row_parallel import RowParallelLinear
from mg.core.parallel.tensor_parallel import (
    ForkedDropoutRNG,
    GatedColwiseParallel,
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
    decoder = set(model.decoder.layers)
    if sequence_parallel and model.config.hidden_dropout > 0:
        # the decoder layers' dropout over the rank's sequence slice: the per-rank stream
        # (the cross-attention's own dropout runs on the whole sequence, before the cut)
        for layer in model.decoder.layers:
            extend_class(layer.hidden_dropout, ForkedDropoutRNG)
            layer.hidden_dropout.tp_rng_stream = model_parallel_stream()
    for layer in layers:
        split = sequence_parallel and layer in decoder  # the encoder's layers see it whole
        if _is_retro(layer):
            _parallelize_retro_layer(layer, tp_mesh, split)
        else:
            _parallelize_layer(layer, tp_mesh, Shard(1) if split else Replicate(), split)
    if sequence_parallel:
        # the tokens' embeddings cut into the ranks' slices at the decoder's input (the
        # neighbours' stay whole); its output, the rank's slice, gathered by the loss
        parallelize_module(
            model.decoder,
            tp_mesh,
            PrepareModuleInput(
                input_layouts=(Replicate(), None, None, None, None),
                desired_input_layouts=(Shard(1), None, None, None, None),
                use_local_output=True,
            ),
        )
        parallelize_module(
            model.decoder,
            tp_mesh,
            PrepareModuleOutput(
                output_layouts=Shard(1), desired_output_layouts=Shard(1), use_local_output=False
            ),
        )
    if isinstance(model.output_layer, nn.Linear):
        parallelize_module(model.output_layer, tp_mesh, ColwiseParallel(), src_data_rank=None)
    model.output_head = VocabParallelOutputHead(tp_mesh)
    model.tensor_parallel_size = tp
    model.sequence_parallel = sequence_parallel


def _is_retro(layer: nn.Module) -> bool:
    return isinstance(layer, RetroDecoderLayer | RetroEncoderLayer)


def _parallelize_retro_layer(
    layer: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = False
) -> None:
    """A GPT layer's plan plus the cross-attention's; with `sequence_parallel` (a decoder
    layer) the activations between the regions are sequence slices, gathered before the
    chunked cross-attention and cut again after it."""
    whole = Replicate()
    activations = Shard(1) if sequence_parallel else whole  # [b, s, h]: dim 1 = sequence
    plan: dict[str, object] = {
        "self_attention": PrepareModuleInput(
            input_layouts=(activations, None, None), desired_input_layouts=(whole, None, None)
        ),
        "self_attention.linear_qkv": ColwiseParallel(),
        "self_attention.linear_proj": RowParallelLinear(output_layouts=activations),
        "mlp": PrepareModuleInput(input_layouts=(activations,), desired_input_layouts=(whole,)),
        "mlp.linear_fc1": GatedColwiseParallel() if layer.mlp.gated else ColwiseParallel(),
        "mlp.linear_fc2": RowParallelLinear(output_layouts=activations),
        "cross_attention.attn": PrepareModuleInput(
            input_layouts=(whole, whole, None), desired_input_layouts=(whole, whole, None)
        ),
        "cross_attention.attn.linear_q": ColwiseParallel(),
        "cross_attention.attn.linear_kv": ColwiseParallel(),  # rows grouped per head
        "cross_attention.attn.linear_proj": RowParallelLinear(output_layouts=whole),
    }
    if sequence_parallel:
        for name in ("input_layernorm", "pre_cross_attn_layernorm", "pre_mlp_layernorm"):
            plan[name] = SequenceParallel()
        # the chunk regrouping needs the whole sequence: gathered before, cut after
        plan["cross_attention"] = PrepareModuleInput(
            input_layouts=(activations, None, None),
            desired_input_layouts=(whole, None, None),
            use_local_output=True,
        )
    parallelize_module(layer, tp_mesh, plan, src_data_rank=None)
    if sequence_parallel:
        parallelize_module(
            layer.cross_attention,
            tp_mesh,
            PrepareModuleOutput(
                output_layouts=(whole, None),
                desired_output_layouts=(activations, None),
                use_local_output=True,
            ),
        )
    tp = tp_mesh.size()
    _use_local_head_counts(layer.self_attention, tp)
    attn = layer.cross_attention.attn
    attn.num_heads //= tp
    _use_local_head_counts_of_core(attn.core_attention, tp)
