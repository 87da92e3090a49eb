"""A Retro checkpoint (`mg-train retro`) read back for generation (`mg-eval`, `mg-serve`).

The checkpoint records a RetroConfig (its ``retro_chunk_length``, neighbours and
retrieved chunks) and, in its args, the ``retro_project_dir`` it was trained on.
Single-shard checkpoints (TP=1, PP=1, `--ckpt-format torch`) are read; dropout is off.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mg.core.checkpoint import CheckpointError, find_rank_file, load_checkpoint
from mg.core.checkpoint.model_io import resolve_tokenizer_paths
from mg.core.checkpoint.torch_format import iteration_dir, resolve_iteration
from mg.core.models.retro import RetroConfig, RetroModel
from mg.core.tokenizers import TokenizerConfig


@dataclass
class RetroCheckpoint:
    model: RetroModel
    config: RetroConfig
    tokenizer_config: TokenizerConfig | None
    iteration: Any
    args: dict[str, Any]
    """The run's flags as saved (``retro_project_dir`` among them)."""


def recorded_model_config(load_dir: str | Path, iteration: Any = None) -> dict[str, Any] | None:
    """The model config a single-shard torch-format checkpoint records (None when it has
    none, or is of another format: those are not Retro checkpoints to this reader)."""
    try:
        state, _ = load_checkpoint(load_dir, iteration, mmap=True)
    except (CheckpointError, OSError, ValueError):
        return None
    return dict((state.get("mg") or {}).get("model_config") or {}) or None


def is_retro_config(model_config: dict[str, Any] | None) -> bool:
    return bool(model_config) and "retro_chunk_length" in model_config


def load_retro_checkpoint(
    load_dir: str | Path, iteration: Any = None, num_neighbors: int | None = None
) -> RetroCheckpoint:
    """The RetroModel of a single-shard checkpoint (fp32, eval mode, CPU). ``num_neighbors``
    replaces the trained k (no weight depends on it). Raises CheckpointError naming
    what does not fit."""
    load_dir = Path(load_dir)
    iteration = resolve_iteration(load_dir, iteration)
    path, layout = find_rank_file(iteration_dir(load_dir, iteration))
    if layout.tp * layout.pp * layout.ep != 1:
        raise CheckpointError(
            f"{load_dir} was saved with {layout}; Retro generation reads single-shard "
            "checkpoints (TP=1 PP=1, --ckpt-format torch)"
        )
    state, iteration = load_checkpoint(load_dir, iteration)
    meta = state.get("mg") or {}
    if not is_retro_config(meta.get("model_config")):
        raise CheckpointError(f"{path}: not a Retro checkpoint (no Retro fields in its config)")
    config = RetroConfig.from_dict(dict(meta["model_config"]))
    config.hidden_dropout = config.attention_dropout = 0.0
    config.retro_encoder_hidden_dropout = config.retro_encoder_attention_dropout = 0.0
    if num_neighbors is not None:
        config.retro_num_neighbors = num_neighbors
    weights = {k: v for k, v in state["model"].items() if not k.endswith("_extra_state")}
    model = RetroModel(config)
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0]
        raise CheckpointError(f"{path}: weights do not fit the recorded config: {first}") from None
    tokenizer_config = None
    if meta.get("tokenizer_config"):
        tokenizer_config = resolve_tokenizer_paths(
            TokenizerConfig.from_dict(dict(meta["tokenizer_config"])), load_dir
        )
    saved = state.get("args")  # mg-train's is Megatron's argparse.Namespace
    args = vars(saved) if isinstance(saved, argparse.Namespace) else dict(saved or {})
    return RetroCheckpoint(model.float().eval(), config, tokenizer_config, iteration, args)
