"""Pipeline parallelism: a built GPTModel cut into stage modules ("model chunks").

With P pipeline ranks and v virtual stages per rank (the interleaved
schedule), the L layers form P·v virtual stages of L/(P·v) consecutive layers;
virtual stage k = c·P + r is model chunk c of pipeline rank r (Megatron's
assignment). So at P=2, v=2, L=8: rank 0 holds layers 0-1 and 4-5, rank 1
layers 2-3 and 6-7. The first virtual stage also holds the embedding, the last
one the final norm and the output layer.

A chunk keeps Megatron's names for what it holds, with the layers numbered
locally (`decoder.layers.0` is the chunk's first layer), which is the key
layout of a Megatron `torch` checkpoint `mp_rank_TT_PPP/` (`model0`,
`model1`… per chunk). `global_parameter_name` maps a chunk's names back to the
whole model's, which is what the layout-agnostic `torch_dist` format stores.

Tied embeddings (the default): the last stage holds its own
`output_layer.weight`, initialised as a copy of the word embeddings, and the
two copies' gradients are summed over the *embedding group* (the first and
last pipeline rank) after backward — Megatron's scheme — so the optimizer
keeps them equal. Only the first stage's copy counts towards the gradient
norm (`is_shared_copy`).

Every rank builds the whole model with the run's seed and keeps its part:
initialisation then equals the single-process model's exactly, at the cost of
building it once per rank (build on the meta device and use `to_empty` +
`init_weights` for models that do not fit).
"""

from __future__ import annotations

import copy
import re

import torch
import torch.distributed as dist
from torch import Tensor, nn

from mg.core.models.bert import BertModel
from mg.core.models.language_model import LanguageModel, LanguageModelParts
from mg.core.models.mtp import MTPLosses
from mg.core.parallel.grad_norm import global_grad_norm  # DTensor (tensor-parallel) aware
from mg.core.parallel.pipeline_bert import BertPipelineChunk
from mg.core.parallel.pipeline_stage import StageBlock, is_shared_copy, tied_output_copy


class PipelineConfigError(ValueError):
    """A pipeline layout Megatron refuses too; the message names the flags."""


def layer_ranges(
    num_layers: int, pipeline_size: int, virtual_size: int = 1
) -> list[list[tuple[int, int]]]:
    """[pipeline rank][model chunk] → (first layer, end layer), Megatron's assignment."""
    if pipeline_size < 1 or virtual_size < 1:
        raise PipelineConfigError("pipeline and virtual pipeline sizes must be >= 1")
    if num_layers % pipeline_size:
        raise PipelineConfigError(
            f"number of layers ({num_layers}) should be divisible by the pipeline parallel "
            f"size ({pipeline_size}); change --num-layers or --pipeline-model-parallel-size"
        )
    if virtual_size > 1:
        if pipeline_size == 1:
            raise PipelineConfigError(
                "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1"
            )
        per_stage = num_layers // pipeline_size
        if per_stage % virtual_size:
            raise PipelineConfigError(
                f"number of layers per pipeline stage ({per_stage}) must be divisible by the "
                f"number of model chunks per stage ({virtual_size})"
            )
    per_chunk = num_layers // (pipeline_size * virtual_size)
    return [
        [
            ((c * pipeline_size + r) * per_chunk, (c * pipeline_size + r + 1) * per_chunk)
            for c in range(virtual_size)
        ]
        for r in range(pipeline_size)
    ]


def virtual_size_from_layers(
    num_layers: int, pipeline_size: int, layers_per_virtual_stage: int | None
) -> int:
    """v from Megatron's --num-layers-per-virtual-pipeline-stage (None → 1)."""
    if layers_per_virtual_stage is None:
        return 1
    if pipeline_size <= 1:
        raise PipelineConfigError(
            "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1"
        )
    per_stage = num_layers // pipeline_size
    if layers_per_virtual_stage < 1 or per_stage % layers_per_virtual_stage:
        raise PipelineConfigError(
            f"number of layers per pipeline stage ({per_stage}) must be divisible by "
            f"--num-layers-per-virtual-pipeline-stage ({layers_per_virtual_stage})"
        )
    return per_stage // layers_per_virtual_stage


class PipelineChunk(LanguageModelParts):
    """Layers [start, end) of a GPTModel (or a hybrid MambaModel: the same embedding and
    head around its pattern's layers), with the embedding if first, the output layer if
    last; the rest of the language-model shell is the whole model's (`LanguageModelParts`).

    forward(input, position_ids, attention_mask, labels): input is token ids
    [b, s] on the first stage and the hidden states [b, s, h] elsewhere; the
    last stage returns the per-token loss [b, s] (or logits without labels),
    the others the hidden states for the next stage. The last stage runs the whole
    model's `output_head` (the one tensor parallelism or the fused loss chose) on its
    own output weight."""

    def __init__(self, model: LanguageModel, start: int, end: int, first: bool, last: bool) -> None:
        norm_name = model.final_norm_name
        decoder = StageBlock(
            list(model.decoder.layers[start:end]),
            getattr(model.decoder, norm_name) if last else None,
            norm_name,
        )
        output_layer = None
        if last:
            if model.output_layer is not None:
                output_layer = model.output_layer
            elif not first:  # tied: the last stage gets its own copy (a DTensor stays one)
                # a placeholder built on meta: its own init would draw from the generator
                output_layer = nn.Linear(1, 1, bias=False, device="meta")
                output_layer.weight = tied_output_copy(model.embedding.word_embeddings.weight)
        mtp = model.mtp if last else None
        embedding = model.embedding if first else None
        if mtp is not None and not first:  # the MTP block embeds tokens on the last stage
            embedding = _last_stage_embedding(model)
            if model.output_layer is None:  # tied: that copy is the output weight too
                output_layer = None
        super().__init__(
            model.config,
            embedding=embedding,
            rotary_pos_emb=model.rotary_pos_emb,
            decoder=decoder,
            output_layer=output_layer,
            output_head=model.output_head,
            mtp=mtp,
        )
        self.layer_offset = start
        self.is_first, self.is_last = first, last
        self.real_vocab_size = model.real_vocab_size  # padding masked beyond it

    def forward(
        self,
        input: Tensor,
        position_ids: Tensor,
        attention_mask: Tensor | None = None,
        labels: Tensor | None = None,
        input_ids: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, MTPLosses]:
        """`input_ids` (the token ids) on the last stage of a model with multi-token
        prediction: it returns (per-token loss, `MTPLosses`) as the whole model's
        `forward(return_mtp=True)` does."""
        hidden = self.embedding(input, position_ids) if self.is_first else input
        hidden = self.run_decoder(hidden, position_ids, attention_mask)
        if not self.is_last:
            return hidden
        if self.mtp is not None and labels is not None and input_ids is not None:
            mtp = self.mtp_losses(hidden, input_ids, position_ids, attention_mask, labels)
            return self.output_and_loss(hidden, labels), mtp
        return self.output_and_loss(hidden, labels)


def _last_stage_embedding(model: LanguageModel) -> nn.Module:
    """The last stage's own embedding for its MTP block, as Megatron keeps one there: the
    model's embedding module (a tensor-parallel one keeps its hooks) on a copy of the word
    embeddings, whose gradient is summed with the first stage's over the embedding group;
    with tied embeddings it is the stage's output weight too (Megatron's MTP stage)."""
    if model.embedding.position_embeddings is not None:
        raise PipelineConfigError(
            "multi-token prediction on a later pipeline stage takes rope or no position "
            "embeddings (Megatron's MTP rule), not learned_absolute"
        )
    embedding = copy.copy(model.embedding)  # its modules' own dicts are copied below
    embedding._modules = dict(embedding._modules)
    words = copy.copy(model.embedding.word_embeddings)
    words._parameters = dict(words._parameters)
    words.weight = tied_output_copy(words.weight)
    embedding.word_embeddings = words
    return embedding


def split_model(
    model: nn.Module, pipeline_rank: int, pipeline_size: int, virtual_size: int = 1
) -> list[nn.Module]:
    """This pipeline rank's model chunks (one, or v with the interleaved schedule):
    `PipelineChunk`s of a GPTModel, `BertPipelineChunk`s of a BertModel."""
    chunk_class = BertPipelineChunk if isinstance(model, BertModel) else PipelineChunk
    ranges = layer_ranges(model.config.num_layers, pipeline_size, virtual_size)[pipeline_rank]
    last_chunk = virtual_size - 1
    return [
        chunk_class(
            model,
            start,
            end,
            first=pipeline_rank == 0 and c == 0,
            last=pipeline_rank == pipeline_size - 1 and c == last_chunk,
        )
        for c, (start, end) in enumerate(ranges)
    ]


def shared_embedding_weight(chunks: list[PipelineChunk]) -> Tensor | None:
    """The tied weight this rank holds (first stage's embedding, last stage's copy), if any;
    None when it is frozen (a VLM's `--freeze-LM`): it has no gradient to sum."""
    weight = _tied_weight(chunks)
    return weight if weight is not None and weight.requires_grad else None


def _tied_weight(chunks: list[PipelineChunk]) -> Tensor | None:
    config = chunks[0].config
    mtp = bool(getattr(config, "mtp_num_layers", None))
    if config.untie_embeddings_and_output_weights and not mtp:
        return None
    for chunk in chunks:
        if chunk.is_first and not chunk.is_last:
            return chunk.embedding.word_embeddings.weight
        if chunk.is_last and not chunk.is_first:
            if chunk.embedding is not None:  # the MTP block's copy (the tied one too)
                return chunk.embedding.word_embeddings.weight
            return chunk.output_layer.weight
    return None


def embedding_group_ranks(pipeline_ranks: list[int]) -> list[int]:
    """Megatron's embedding group of one pipeline: its first and last rank."""
    return [pipeline_ranks[0], pipeline_ranks[-1]] if len(pipeline_ranks) > 1 else pipeline_ranks


def allreduce_shared_embedding_grad(
    chunks: list[PipelineChunk], embedding_group: dist.ProcessGroup | None
) -> None:
    """Sum the tied weight's gradient over the first and last stage (after backward)."""
    weight = shared_embedding_weight(chunks)
    if weight is None or embedding_group is None:
        return
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    grad = weight.grad
    # a tensor-parallel DTensor: each tp rank sums its own vocab shard with its peer's
    local = grad.to_local() if hasattr(grad, "to_local") else grad
    dist.all_reduce(local, group=embedding_group)


_LAYER = re.compile(r"^(decoder|encoder)\.layers\.(\d+)\.")  # GPT's decoder, BERT's encoder


_LANGUAGE_MODEL = "language_model."  # a vision-language chunk's GPT part (pipeline_vision)


def global_parameter_name(chunk: PipelineChunk, local_name: str) -> str | None:
    """The whole model's name for a chunk's state-dict key (None: the tied copy, not stored).
    A vision-language chunk's language model is a `PipelineChunk` under `language_model.`."""
    inner = getattr(chunk, "language_model", None)
    if isinstance(inner, PipelineChunk) and local_name.startswith(_LANGUAGE_MODEL):
        name = global_parameter_name(inner, local_name[len(_LANGUAGE_MODEL) :])
        return None if name is None else _LANGUAGE_MODEL + name
    if local_name == "output_layer.weight" and is_shared_copy(chunk.output_layer.weight):
        return None
    if local_name == "embedding.word_embeddings.weight" and not chunk.is_first:
        return None  # the last stage's copy for its MTP block
    match = _LAYER.match(local_name)
    if match:
        index = int(match.group(2)) + chunk.layer_offset
        return f"{match.group(1)}.layers.{index}." + local_name[match.end() :]
    return local_name


def tied_weight_name(chunk: nn.Module) -> str:
    """The whole model's name of the embedding a last stage's tied copy stands for."""
    inner = getattr(chunk, "language_model", None)
    prefix = _LANGUAGE_MODEL if isinstance(inner, PipelineChunk) else ""
    return prefix + "embedding.word_embeddings.weight"


def global_state_dict(chunks: list[PipelineChunk]) -> dict[str, Tensor]:
    """The chunks' tensors under the whole model's names (for `torch_dist` checkpoints)."""
    out: dict[str, Tensor] = {}
    for chunk in chunks:
        for name, tensor in chunk.state_dict().items():
            global_name = global_parameter_name(chunk, name)
            if global_name is not None:
                out[global_name] = tensor
    return out


def load_global_state_dict(chunks: list[PipelineChunk], state: dict[str, Tensor]) -> None:
    """Fill the chunks from whole-model names (any pipeline layout saved it); strict."""
    for chunk in chunks:
        local: dict[str, Tensor] = {}
        for name in chunk.state_dict():
            global_name = global_parameter_name(chunk, name)
            if global_name is None:  # tied copy on the last stage
                global_name = tied_weight_name(chunk)
            if global_name not in state:
                raise KeyError(f"checkpoint has no tensor {global_name!r} (for {name!r})")
            local[name] = state[global_name]
        chunk.load_state_dict(local, strict=True)


@torch.no_grad()
def clip_grad_norm_across_stages(
    parameters: list[Tensor], max_norm: float, pipeline_group: dist.ProcessGroup | None
) -> float:
    """Global L2 gradient norm over all pipeline stages, clipped to `max_norm` if > 0.

    Each stage adds the squares of its own gradients (the tied embedding's last-
    stage copy left out, so it counts once) and the sums are all-reduced over
    the pipeline group; every stage then scales by the same coefficient, as
    Megatron's `clip_grad_norm_fp32`. A non-finite norm is returned as nan."""
    grads = [p.grad for p in parameters if p.grad is not None]
    counted = [p.grad for p in parameters if p.grad is not None and not is_shared_copy(p)]
    square = torch.tensor(global_grad_norm(counted), dtype=torch.float64) ** 2
    if pipeline_group is not None and dist.get_world_size(pipeline_group) > 1:
        if dist.get_backend(pipeline_group) == "nccl":
            square = square.cuda()
        dist.all_reduce(square, group=pipeline_group)
    norm = float(square) ** 0.5
    if norm != norm or norm == float("inf"):
        return float("nan")
    if max_norm > 0:
        coefficient = max_norm / (norm + 1e-6)
        if coefficient < 1.0:
            for grad in grads:
                (grad.to_local() if hasattr(grad, "to_local") else grad).mul_(coefficient)
    return norm


def global_view(chunks: list[PipelineChunk]) -> nn.Module:
    """A module whose parameters are this rank's, named as in the whole model.

    For layout-agnostic checkpoints (`torch_dist`): `global_view(chunks).state_dict()`
    and `torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(view, opt)`
    then carry whole-model names, so a save at one pipeline size loads at another.
    The last stage's tied copy is named `embedding.word_embeddings.weight` too: its
    values and optimizer state equal the first stage's, so either copy serves."""
    root = nn.Module()
    for chunk in chunks:
        tensors = dict(chunk.named_parameters())
        tensors.update(dict(chunk.named_buffers()))
        for local, tensor in tensors.items():
            name = global_parameter_name(chunk, local) or tied_weight_name(chunk)
            *path, leaf = name.split(".")
            module = root
            for part in path:
                child = module._modules.get(part)
                if child is None:
                    child = nn.Module()
                    module.add_module(part, child)
                module = child
            if isinstance(tensor, nn.Parameter):
                module.register_parameter(leaf, tensor)
            else:
                module.register_buffer(leaf, tensor)
    return root
