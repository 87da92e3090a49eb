"""Tensor parallelism for a LLaVA model: each tower sharded as Megatron shards it.

    language_model     the GPT's plan (`apply_tensor_parallel`)
    vision_model       its layers are GPT layers (bidirectional): the same per-layer plan,
                       linear_qkv / linear_fc1 column-parallel, linear_proj / linear_fc2
                       row-parallel; conv1, class token, positions and norms replicated
    vision_projection  encoder.linear_fc1 column-parallel, encoder.linear_fc2 row-parallel
                       (Megatron's MultimodalProjector MLP), its output whole on every rank

With sequence parallelism only the language model's layers take sequence slices (cut
after the image rows are spliced in); the towers see whole sequences, as Megatron's.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleOutput,
    parallelize_module,
)

from mg.core.models.vision import LLaVAModel
from mg.core.parallel.row_parallel import RowParallelLinear
from mg.core.parallel.tensor_parallel import (
    TensorParallelError,
    _parallelize_layer,  # the GPT's plan of one layer: the ViT's layers are GPT layers
    apply_tensor_parallel,
)


def check_llava_tensor_parallel_sizes(model: LLaVAModel, tp: int) -> None:
    """The vision tower's heads and the projector's width split evenly over `tp`."""
    vision, ffn = model.config.vision, model.config.projector_ffn_hidden_size
    for what, size in (
        ("the vision tower's attention heads", vision.num_attention_heads),
        ("the vision tower's MLP width", vision.ffn_hidden_size),
        ("the projector's inner width", ffn),
    ):
        if size % tp:
            raise TensorParallelError(f"tensor parallel size {tp} does not divide {what} ({size})")


def apply_llava_tensor_parallel(
    model: LLaVAModel,
    tp_mesh: DeviceMesh,
    sequence_parallel: bool,
    seed: int | None = None,
    device: torch.device | None = None,
) -> None:
    """Shard `model` in place over the 1-D `tp_mesh` (every TP rank calls this, with the
    same materialized model: each keeps its slices). With `sequence_parallel` the
    language model's layers work on sequence slices, which the combined text and image
    embeddings are cut into after the splice (`decoder_input`); the vision tower and the
    projector see whole sequences, as Megatron's (`sequence_parallel = False` for both)."""
    check_llava_tensor_parallel_sizes(model, tp_mesh.size())
    apply_tensor_parallel(
        model.language_model,
        tp_mesh,
        sequence_parallel,
        seed=seed,
        device=device,
        scatter_embedding=False,
    )
    if sequence_parallel:
        parallelize_module(
            model.decoder_input,
            tp_mesh,
            PrepareModuleOutput(
                output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=True
            ),
        )
    for layer in model.vision_model.decoder.layers:
        _parallelize_layer(layer, tp_mesh, Replicate(), False)
    parallelize_module(
        model.vision_projection.encoder,
        tp_mesh,
        {
            "linear_fc1": ColwiseParallel(),
            "linear_fc2": RowParallelLinear(output_layouts=Replicate()),
        },
        src_data_rank=None,
    )
    # what the training loop reads off a sharded model (the norm over TP ranks, ...)
    model.tensor_parallel_size = tp_mesh.size()
    model.sequence_parallel = sequence_parallel
