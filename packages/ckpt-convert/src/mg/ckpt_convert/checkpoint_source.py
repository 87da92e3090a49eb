"""Open an mg checkpoint of any format and layout as one whole model, read lazily.

`torch` format: every ``mp_rank_TT[_PPP]/model_optim_rng.pt`` is memory-mapped
(nothing is read until a tensor is asked for), the pipeline stages' local
layer names are mapped to the whole model's (:mod:`mg.core.checkpoint.pp_split`,
virtual stages ``model0``, ``model1``… included) and a tensor's TP shards are
joined only when :meth:`CheckpointSource.tensor` asks for it. `torch_dist`:
DCP reads the whole tensors (they are stored unsharded by name).
"""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mg.ckpt_convert.errors import ConvertError
from mg.core.checkpoint import MODEL_FILENAME, find_rank_file, saved_layout
from mg.core.checkpoint.dist_format import is_torch_dist, load_common, load_full_state
from mg.core.checkpoint.layout import Iteration
from mg.core.checkpoint.pp_split import merge_pipeline
from mg.core.checkpoint.serialization import load_file
from mg.core.checkpoint.torch_format import iteration_dir, resolve_iteration
from mg.core.checkpoint.tp_merge import merge_tensor_parallel
from mg.core.models import ConfigError, GPTModel, TransformerConfig

# Entries that describe one rank's optimizer or random state: their layout depends on
# the parallel layout, so a conversion drops them (Megatron's converter does the same).
LAYOUT_BOUND = ("optimizer", "rng_state")
TOKENIZER_PATH_FIELDS = ("vocab_file", "merge_file", "tokenizer_model")


@dataclass
class CheckpointSource:
    """A checkpoint's whole-model view: names, configs, and tensors joined on demand."""

    load_dir: Path
    folder: Path
    iteration: Iteration
    format: str  # "torch" or "torch_dist"
    tp: int
    pp: int
    config: TransformerConfig
    state: dict[str, Any]
    """Rank 0's entries other than the model (args, mg, scheduler, …)."""
    shards: dict[str, list[Tensor]] = field(repr=False)
    """Whole-model name → its tensor-parallel shards in rank order ([whole] if unsplit)."""

    @property
    def names(self) -> list[str]:
        return list(self.shards)

    def tensor(self, name: str) -> Tensor:
        """The whole tensor ``name`` (TP shards joined along Megatron's partition dim)."""
        parts = self.shards[name]
        if len(parts) == 1:
            return parts[0]
        merged = merge_tensor_parallel([{name: p} for p in parts], self.config.gated_linear_unit)
        return merged[name]

    @property
    def args(self) -> dict[str, Any]:
        raw = self.state.get("args")
        return vars(raw) if isinstance(raw, argparse.Namespace) else dict(raw or {})

    @property
    def dropped(self) -> list[str]:
        """Layout-bound entries the source has (and a conversion leaves out)."""
        return [k for k in LAYOUT_BOUND if self.state.get(k)]


def open_checkpoint(
    load_dir: str | Path, iteration: Iteration | None = None, *, check_gpt: bool = True
) -> CheckpointSource:
    """Open ``load_dir`` (latest iteration unless given); with `check_gpt`, checks that it
    holds a whole GPT model (reshard and format conversion need one; export also reads BERT)."""
    load_dir = Path(load_dir)
    iteration = resolve_iteration(load_dir, iteration)
    folder = iteration_dir(load_dir, iteration)
    if is_torch_dist(folder):
        source = _open_torch_dist(load_dir, folder, iteration)
    else:
        source = _open_torch(load_dir, folder, iteration)
    if check_gpt:
        _check_names(source)
    return source


def _config(state: Mapping[str, Any], where: Path) -> TransformerConfig:
    meta = state.get("mg") or {}
    if not meta.get("model_config"):
        raise ConvertError(
            f"{where} records no model config (state['mg']['model_config']); it was not written "
            "by mg tools. For a Megatron-LM checkpoint run `mg-convert import-megatron` first."
        )
    try:
        config = TransformerConfig.from_dict(dict(meta["model_config"]))
    except ConfigError as exc:
        raise ConvertError(f"{where}: the recorded model config is not valid: {exc}") from None
    if config.num_moe_experts:
        raise ConvertError(f"{where}: MoE checkpoints (num_moe_experts) are not supported yet")
    return config


def _open_torch_dist(load_dir: Path, folder: Path, iteration: Iteration) -> CheckpointSource:
    common = load_common(folder)
    config = _config(common, folder)
    parallel = (common.get("mg") or {}).get("parallel") or {}
    weights = load_full_state(folder)
    return CheckpointSource(
        load_dir,
        folder,
        iteration,
        "torch_dist",
        int(parallel.get("tp", 1)),
        int(parallel.get("pp", 1)),
        config,
        common,
        {name: [tensor] for name, tensor in weights.items()},
    )


def _chunks(state: Mapping[str, Any], path: Path) -> list[Mapping[str, Any]]:
    """``model``, or ``model0``, ``model1``… (virtual pipeline stages), in order."""
    if isinstance(state.get("model"), Mapping):
        return [state["model"]]
    virtual = sorted(
        (int(k[5:]), v) for k, v in state.items() if k[5:].isdigit() and k.startswith("model")
    )
    if not virtual:
        raise ConvertError(f"{path} holds no 'model' entry")
    return [v for _, v in virtual]


def _open_torch(load_dir: Path, folder: Path, iteration: Iteration) -> CheckpointSource:
    layout = saved_layout(folder)
    if layout is None:
        find_rank_file(folder)  # raises the format's own message
    if layout.ep > 1:
        raise ConvertError(f"{folder} was saved with {layout}; expert parallelism is not supported")
    # stages[pp_rank][chunk][local name] -> [shard of tp rank 0, 1, ...]
    stages: list[list[dict[str, list[Tensor]]]] = []
    first_state: dict[str, Any] = {}
    for pp_rank in range(layout.pp):
        chunks: list[dict[str, list[Tensor]]] | None = None
        for tp_rank in range(layout.tp):
            path, _ = find_rank_file(folder, tp_rank, pp_rank, layout.pp)
            state = load_file(path, mmap=True)
            models = _chunks(state, path)
            if pp_rank == tp_rank == 0:
                first_state = {k: v for k, v in state.items() if not k.startswith("model")}
            if chunks is None:
                chunks = [{} for _ in models]
            if len(models) != len(chunks):
                raise ConvertError(
                    f"{path} holds {len(models)} model chunks, tensor-parallel rank 0 of the "
                    f"same stage {len(chunks)}: the checkpoint is inconsistent"
                )
            for chunk, model in zip(chunks, models, strict=True):
                if tp_rank and set(chunk) != {k for k in model if not k.endswith("_extra_state")}:
                    raise ConvertError(
                        f"{path} holds other tensors than tensor-parallel rank 0 of the same "
                        "stage: the checkpoint is inconsistent"
                    )
                for name, tensor in model.items():
                    if not name.endswith("_extra_state"):
                        chunk.setdefault(name, []).append(tensor)
        stages.append(chunks or [])
    config = _config(first_state, folder / layout.rank_dirname(0) / MODEL_FILENAME)
    tied = not config.untie_embeddings_and_output_weights
    try:
        shards = merge_pipeline(stages, config.num_layers, tied=tied)
    except ValueError as exc:
        raise ConvertError(f"{folder}: {exc}") from None
    return CheckpointSource(
        load_dir, folder, iteration, "torch", layout.tp, layout.pp, config, first_state, shards
    )


def _check_names(source: CheckpointSource) -> None:
    with torch.device("meta"):
        expected = GPTModel(source.config).state_dict()
    unexpected = [n for n in source.names if n not in expected]
    missing = [n for n in expected if n not in source.shards]
    if unexpected or missing:
        raise ConvertError(
            f"{source.folder}: the weights do not fit the GPT model its config describes "
            f"(unexpected {unexpected[:4]}, missing {missing[:4]}); only GPT-family "
            "checkpoints can be converted"
        )


def copy_tokenizer_files(source: CheckpointSource, target: Path) -> None:
    """Copy tokenizer files the config names relative to the source folder (kept relative)."""
    tokenizer = (source.state.get("mg") or {}).get("tokenizer_config") or {}
    for name in TOKENIZER_PATH_FIELDS:
        value = tokenizer.get(name)
        if not value or Path(value).is_absolute():
            continue
        top = Path(value).parts[0]  # the whole folder (tokenizer/), not just the named file
        src, dst = source.load_dir / top, target / top
        if dst.exists() or not src.exists():
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst)
        else:
            shutil.copy2(src, dst)
