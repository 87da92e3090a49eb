"""A Retro checkpoint (`mg-train retro`) and its retriever, for generation with retrieval.

The checkpoint records a RetroConfig (its ``retro_chunk_length``, neighbours and
retrieved chunks) and, in its args, the ``retro_project_dir`` it was trained on;
``--retro-project-dir`` names another copy of that project. The project must hold
a finished index (`mg-prep retro --retro-tasks index-build`) made with the model's
tokenizer and chunk length; anything else is a one-line error naming the flag.
Single-shard checkpoints (TP=1, PP=1, `--ckpt-format torch`) are read.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mg.core.checkpoint import CheckpointError, find_rank_file, load_checkpoint
from mg.core.checkpoint.torch_format import iteration_dir, resolve_iteration
from mg.core.models.retro import RetroConfig, RetroModel
from mg.core.models.vocab_mask import set_real_vocab_size, unpadded_vocab_size
from mg.core.retro.project import RetroProjectError
from mg.core.retro.retrieval import Retriever, open_retriever
from mg.core.tokenizers import TokenizerConfig
from mg.core.tokenizers.base import BaseTokenizer
from mg.evaluate.errors import EvalInputError
from mg.evaluate.model_loading import eval_tokenizer
from mg.indexed_dataset import IndexedDataset


@dataclass
class LoadedRetro:
    model: RetroModel
    config: RetroConfig
    tokenizer: BaseTokenizer
    iteration: Any
    args: dict[str, Any]


def recorded_model_config(load_dir: str | Path, iteration: Any = None) -> dict[str, Any] | None:
    """The model config a single-shard torch-format checkpoint records (None when it has
    none, or is another format: those are GPT checkpoints to core's loader)."""
    try:
        state, _ = load_checkpoint(load_dir, iteration, mmap=True)
    except CheckpointError:
        return None
    return dict((state.get("mg") or {}).get("model_config") or {}) or None


def is_retro_config(model_config: dict[str, Any] | None) -> bool:
    return bool(model_config) and "retro_chunk_length" in model_config


def load_retro(
    load_dir: str | Path,
    iteration: Any = None,
    tokenizer_overrides: dict[str, Any] | None = None,
    num_neighbors: int | None = None,
) -> LoadedRetro:
    """The RetroModel of a single-shard checkpoint, fp32, eval mode, on the first GPU or
    the CPU, with its tokenizer and saved args. ``num_neighbors`` (--retro-num-neighbors)
    replaces the trained k: no weight depends on it."""
    load_dir = Path(load_dir)
    if not load_dir.is_dir():
        raise EvalInputError("no such checkpoint folder (--load)", load_dir)
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
        raise EvalInputError("not a Retro checkpoint (its model config has no Retro fields)", path)
    config = RetroConfig.from_dict(dict(meta["model_config"]))
    config.hidden_dropout = config.attention_dropout = 0.0
    config.retro_encoder_hidden_dropout = config.retro_encoder_attention_dropout = 0.0
    if num_neighbors is not None:
        if num_neighbors < 1:
            raise EvalInputError(f"--retro-num-neighbors must be >= 1, got {num_neighbors}")
        config.retro_num_neighbors = num_neighbors
    weights = {k: v for k, v in state["model"].items() if not k.endswith("_extra_state")}
    model = RetroModel(config)
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0]
        raise CheckpointError(f"{path}: weights do not fit the recorded config: {first}") from None
    tok_config = None
    if meta.get("tokenizer_config"):
        tok_config = TokenizerConfig.from_dict(dict(meta["tokenizer_config"]))
    tokenizer = eval_tokenizer(tok_config, tokenizer_overrides, load_dir, config.vocab_size)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = model.to(device=device, dtype=torch.float32).eval()
    set_real_vocab_size(model, unpadded_vocab_size(config, tokenizer.vocab_size))
    saved = state.get("args")  # mg-train's is Megatron's argparse.Namespace
    args = vars(saved) if isinstance(saved, argparse.Namespace) else dict(saved or {})
    return LoadedRetro(model, config, tokenizer, iteration, args)


def retriever_for(loaded: LoadedRetro, project_dir: str | None) -> Retriever:
    """The retriever of ``project_dir`` (default: the checkpoint's retro_project_dir) for the
    loaded model, as many neighbours per chunk as its config says."""
    project_dir = project_dir or loaded.args.get("retro_project_dir")
    if not project_dir:
        raise EvalInputError(
            "the checkpoint records no retro_project_dir; give --retro-project-dir (the "
            "mg-prep retro folder the model was trained on)"
        )
    if not Path(project_dir).is_dir():
        raise EvalInputError(f"--retro-project-dir {project_dir}: no such folder")
    try:
        return open_retriever(
            project_dir,
            loaded.tokenizer,
            loaded.config.retro_chunk_length,
            loaded.config.retro_num_neighbors,
            loaded.config.retro_num_retrieved_chunks,
            IndexedDataset,
        )
    except RetroProjectError as err:
        raise EvalInputError(str(err)) from None
