"""A vision-language (LLaVA) checkpoint for serving: the model whole, on one process.

Core's `load_model` builds decoder models; a LLaVA checkpoint records an
`LLaVAConfig` (its `language` and `vision` towers) instead. Both formats are read:
`torch` (one rank file: a checkpoint saved with tensor or pipeline parallelism is
refused by name) and `torch_dist` (any layout, read whole).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mg.core.checkpoint.dist_format import is_torch_dist, load_common, load_model_tensors
from mg.core.checkpoint.layout import CheckpointError, Iteration
from mg.core.checkpoint.model_io import resolve_tokenizer_paths
from mg.core.checkpoint.torch_format import (
    find_rank_file,
    iteration_dir,
    load_checkpoint,
    resolve_iteration,
)
from mg.core.models.vision.llava import LLaVAConfig, LLaVAModel
from mg.core.tokenizers import TokenizerConfig


def _state(load_dir: Path, iteration: Iteration | None) -> tuple[dict[str, Any], Path, bool]:
    iteration = resolve_iteration(load_dir, iteration)
    folder = iteration_dir(load_dir, iteration)
    if is_torch_dist(folder):
        return load_common(folder), folder, True
    path, layout = find_rank_file(folder)
    if layout.tp > 1 or layout.pp > 1:
        raise CheckpointError(
            f"{folder}: a vision-language checkpoint saved with {layout} in the torch format "
            "is served from one rank file only; save it with --ckpt-format torch_dist"
        )
    return load_checkpoint(load_dir, iteration)[0], folder, False


def is_vlm_checkpoint(load_dir: str | Path, iteration: Iteration | None = None) -> bool:
    """Whether the checkpoint records a LLaVA model config (towers `language`, `vision`)."""
    try:
        iteration = resolve_iteration(load_dir, iteration)
        folder = iteration_dir(load_dir, iteration)
        if is_torch_dist(folder):
            state = load_common(folder)
        else:
            path, _ = find_rank_file(folder)
            state = torch.load(path, map_location="meta", weights_only=False, mmap=True)
    except Exception:  # noqa: BLE001 - not readable here: load_model names what is wrong
        return False
    config = (state.get("mg") or {}).get("model_config") or {}
    return "vision" in config and "language" in config


def load_vlm(
    load_dir: str | Path, iteration: Iteration | None = None
) -> tuple[LLaVAModel, LLaVAConfig, TokenizerConfig | None]:
    """The LLaVA model (eval mode, on the CPU), its config and its tokenizer config."""
    load_dir = Path(load_dir)
    state, folder, dist = _state(load_dir, iteration)
    meta = state.get("mg") or {}
    config = LLaVAConfig.from_dict(dict(meta["model_config"]))
    model = LLaVAModel(config)
    if dist:  # filled in place, by Megatron-Core's keys (each tower its own layer axis)
        load_model_tensors(folder, model.state_dict(), config)
    else:
        weights = {k: v for k, v in state["model"].items() if not k.endswith("_extra_state")}
        try:
            model.load_state_dict(weights, strict=True)
        except RuntimeError as exc:
            message = f"{folder}: weights do not fit the recorded model config: {exc}"
            raise CheckpointError(message) from None
    tokenizer_config = None
    if meta.get("tokenizer_config"):
        tokenizer_config = resolve_tokenizer_paths(
            TokenizerConfig.from_dict(dict(meta["tokenizer_config"])), load_dir
        )
    return model.eval(), config, tokenizer_config
