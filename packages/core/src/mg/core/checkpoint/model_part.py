"""A checkpoint read into one rank's part of a GPT or a hybrid: its pipeline stage, its TP shards.

Evaluation and serving under torchrun hold the model as the trainer does: each
rank builds the model on the meta device, applies tensor parallelism and keeps
its pipeline stage there, gives storage to what is left and reads only that
from the checkpoint, whatever layout it was saved in:

- `torch_dist`: torch.distributed.checkpoint reads each rank's regions of the
  stored tensors (DTensor shards, the stage's layers by their global names);
- `torch` (`mp_rank_TT[_PPP]` files): the files are memory-mapped, stages are
  matched by name, and each tensor is read one at a time: straight from the
  file of this rank's tensor-parallel position when the saved TP size is the
  run's, otherwise merged from the saved shards (one whole tensor at a time)
  and sliced.

So a rank's peak is its part plus one tensor, never the whole model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from mg.core.checkpoint.dist_format import is_torch_dist, load_model_tensors
from mg.core.checkpoint.layout import CheckpointError, Iteration
from mg.core.checkpoint.model_io import ModelInfo, described_common, model_chunks, model_configs
from mg.core.checkpoint.pp_split import merge_pipeline
from mg.core.checkpoint.serialization import load_file
from mg.core.checkpoint.torch_format import (
    find_rank_file,
    iteration_dir,
    load_checkpoint,
    resolve_iteration,
)
from mg.core.checkpoint.tp_merge import merge_tensor_parallel, partition_dim
from mg.core.models.config import TransformerConfig
from mg.core.models.mamba import decoder_model
from mg.core.parallel.construct import LOADING_STEPS, ConstructOptions, PipelineModel, construct
from mg.core.parallel.layout import ParallelLayout
from mg.core.parallel.materialize import copy_shard, owned_tensors
from mg.core.quantization.apply import parallel_load_refusal, recorded_quantization
from mg.core.tokenizers.config import TokenizerConfig


@dataclass
class ModelPart:
    """What this rank holds of a checkpoint's model, and what the checkpoint says of it."""

    parts: list[nn.Module]
    """The whole model (sharded over TP when tp > 1), or this rank's pipeline chunks."""
    config: TransformerConfig
    tokenizer_config: TokenizerConfig | None
    info: ModelInfo

    @property
    def module(self) -> nn.Module:
        """The model (pp = 1) or the single pipeline chunk of this rank."""
        if len(self.parts) != 1:
            raise ValueError(f"this rank holds {len(self.parts)} model chunks, not one")
        return self.parts[0]


def load_model_part(
    load_dir: str | Path,
    layout: ParallelLayout,
    iteration: Iteration | None = None,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    tensor_parallel_error: type[Exception] | None = None,
) -> ModelPart:
    """This rank's part of the checkpoint's GPT in `layout`, in eval mode (collective for
    `torch_dist` checkpoints: every rank of the world calls it)."""
    load_dir, device = Path(load_dir), torch.device(device)
    iteration = resolve_iteration(load_dir, iteration)
    folder = iteration_dir(load_dir, iteration)
    dist_format = is_torch_dist(folder)
    if dist_format:
        state, path = described_common(folder), folder
    else:
        path, _ = find_rank_file(folder)
        state = load_file(path, mmap=True)
    config, tokenizer_config = model_configs(state, path, load_dir)
    quantization = recorded_quantization(state)
    if quantization is not None:
        raise CheckpointError(parallel_load_refusal(load_dir, quantization, layout.tp, layout.pp))
    with torch.device("meta"):
        model = decoder_model(config)  # a GPTModel, or a hybrid MambaModel
    # the construction path's loading subset: shard, split, storage the checkpoint fills
    options = ConstructOptions(layout=layout, device=device, perform_initialization=False)
    built = construct(model, options, LOADING_STEPS)
    parts: list[nn.Module] = built.chunks if isinstance(built, PipelineModel) else [built]
    owned = owned_tensors(parts)
    with torch.no_grad():
        if dist_format:
            _read_dist(folder, owned, config)
        else:
            _read_torch_format(load_dir, folder, iteration, config, owned, layout)
    for part in parts:
        if dtype is not None:
            part.to(dtype)
        part.eval()
    extra = {k: v for k, v in state.items() if k not in ("model", "optimizer", "args")}
    info = ModelInfo(load_dir, iteration, path, state.get("args"), extra)
    return ModelPart(parts, config, tokenizer_config, info)


def _read_dist(folder: Path, owned: Mapping[str, list[Tensor]], config: TransformerConfig) -> None:
    """DCP reads each owned tensor's region; copies (the tied one) take the first's values."""
    request = {name: tensors[0] for name, tensors in owned.items()}
    load_model_tensors(folder, request, config)
    for tensors in owned.values():
        for copy in tensors[1:]:
            _local(copy).copy_(_local(tensors[0]))


def _read_torch_format(
    load_dir: Path,
    folder: Path,
    iteration: Iteration,
    config: TransformerConfig,
    owned: Mapping[str, list[Tensor]],
    layout: ParallelLayout,
) -> None:
    """Each owned tensor from the memory-mapped rank files, one tensor at a time."""
    _, saved = find_rank_file(folder)
    if saved.ep != 1:
        raise CheckpointError(
            f"{load_dir} was saved with {saved}; expert-parallel `torch` checkpoints are not "
            "read here. Merge it first: mg-convert reshard, or save with --ckpt-format torch_dist"
        )
    tied = not config.untie_embeddings_and_output_weights
    by_tp: list[dict[str, Tensor]] = []
    for tp in range(saved.tp):
        stages = []
        for pp in range(saved.pp):
            state, _ = load_checkpoint(
                load_dir, iteration, tp_rank=tp, pp_rank=pp, pp_size=saved.pp, mmap=True
            )
            stages.append(model_chunks(state, folder))
        by_tp.append(merge_pipeline(stages, config.num_layers, tied=tied))
    for name, tensors in owned.items():
        if name not in by_tp[0]:
            raise CheckpointError(f"{folder}: the checkpoint has no tensor {name!r}")
        for target in tensors:
            _fill(target, name, by_tp, layout, config)


def _fill(
    target: Tensor,
    name: str,
    by_tp: list[dict[str, Tensor]],
    layout: ParallelLayout,
    config: TransformerConfig,
) -> None:
    same_split = isinstance(target, DTensor) and len(by_tp) == layout.tp
    if same_split and partition_dim(name) is not None:
        # Megatron's shard of TP rank r is DTensor's local shard r (strided gate/up included)
        _local(target).copy_(by_tp[layout.tp_rank][name])
        return
    shards = [{name: shard[name]} for shard in by_tp]
    full = merge_tensor_parallel(shards, config.gated_linear_unit, config)[name]
    copy_shard(target, full)


def _local(tensor: Tensor) -> Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def parameters_held(parts: list[nn.Module]) -> int:
    """Parameter elements this rank holds (local shards counted, not the global shapes)."""
    return sum(_local(p).numel() for part in parts for p in part.parameters())
