"""A Retro checkpoint (`mg-train retro`) and its retriever, for generation with retrieval.

The checkpoint records a RetroConfig (its ``retro_chunk_length``, neighbours and
retrieved chunks) and, in its args, the ``retro_project_dir`` it was trained on;
``--retro-project-dir`` names another copy of that project. The project must hold
a finished index (`mg-prep retro --retro-tasks index-build`) made with the model's
tokenizer and chunk length; anything else is a one-line error naming the flag.
The checkpoint is read by `mg.core.retro.checkpoint` (single shard), as mg-serve reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mg.core.models.retro import RetroConfig, RetroModel
from mg.core.models.vocab_mask import set_real_vocab_size, unpadded_vocab_size
from mg.core.retro.checkpoint import load_retro_checkpoint
from mg.core.retro.project import RetroProjectError
from mg.core.retro.retrieval import Retriever, open_checkpoint_retriever
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
    if num_neighbors is not None and num_neighbors < 1:
        raise EvalInputError(f"--retro-num-neighbors must be >= 1, got {num_neighbors}")
    ckpt = load_retro_checkpoint(load_dir, iteration, num_neighbors)
    config = ckpt.config
    tokenizer = eval_tokenizer(
        ckpt.tokenizer_config, tokenizer_overrides, load_dir, config.vocab_size
    )
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = ckpt.model.to(device=device, dtype=torch.float32).eval()
    set_real_vocab_size(model, unpadded_vocab_size(config, tokenizer.vocab_size))
    return LoadedRetro(model, config, tokenizer, ckpt.iteration, ckpt.args)


def retriever_for(loaded: LoadedRetro, project_dir: str | None) -> Retriever:
    """The retriever of ``project_dir`` (default: the checkpoint's retro_project_dir) for the
    loaded model, as many neighbours per chunk as its config says."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return open_checkpoint_retriever(
            project_dir, loaded.args, "the checkpoint", loaded.tokenizer, loaded.config,
            IndexedDataset, device,
        )  # fmt: skip
    except RetroProjectError as err:
        raise EvalInputError(str(err)) from None
