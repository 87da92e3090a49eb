"""A checkpoint folder in, a model and its tokenizer out, ready to serve."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from mg.core.checkpoint import CheckpointError, load_model
from mg.core.models import GPTModel, TransformerConfig
from mg.core.tokenizers import BaseTokenizer, TokenizerConfig, build_tokenizer


class ServeSetupError(Exception):
    """The server cannot start; the message says what to change."""


@dataclass
class LoadedModel:
    model: GPTModel
    config: TransformerConfig
    tokenizer: BaseTokenizer
    tokenizer_config: TokenizerConfig
    name: str
    """What /v1/models and responses call the model: the checkpoint folder's name."""


def check_single_process() -> None:
    """Tensor-parallel serving under torchrun is not built yet: refuse, do not hang."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        raise ServeSetupError(
            f"mg-serve under torchrun (WORLD_SIZE={world}) is not supported yet: tensor-parallel "
            "serving is not built. Run one process: mg-serve --load DIR (merge a TP>1 checkpoint "
            "first with mg-convert reshard --target-tensor-parallel-size 1)."
        )


def load_for_serving(
    load: str | Path,
    device: str = "cpu",
    dtype: str | None = None,
    iteration: str | int | None = None,
) -> LoadedModel:
    """Rebuild the checkpoint's model and tokenizer from its own metadata (no model flags)."""
    check_single_process()
    if isinstance(iteration, str) and iteration.isdigit():
        iteration = int(iteration)
    try:
        model, config, tokenizer_config, _info = load_model(load, iteration)
    except CheckpointError as exc:
        raise ServeSetupError(str(exc)) from None
    if tokenizer_config is None:
        raise ServeSetupError(
            f"{load} records no tokenizer; a server needs one to turn text into tokens. "
            "Re-save it with mg-train --tokenizer-type ... or import it with mg-convert."
        )
    try:
        tokenizer = build_tokenizer(tokenizer_config)
    except ValueError as exc:
        raise ServeSetupError(f"{load}: its tokenizer cannot be built: {exc}") from None
    if dtype is not None:
        model = model.to(getattr(torch, dtype))
    model = model.to(device).eval()
    return LoadedModel(model, config, tokenizer, tokenizer_config, Path(load).resolve().name)
