"""A checkpoint folder in, a model and its tokenizer out, ready to serve."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.device_mesh import DeviceMesh

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


def load_for_serving(
    load: str | Path,
    device: str = "cpu",
    dtype: str | None = None,
    iteration: str | int | None = None,
    tp_mesh: DeviceMesh | None = None,
) -> LoadedModel:
    """Rebuild the checkpoint's model and tokenizer from its own metadata (no model flags).

    With `tp_mesh` (every rank of it calls this) the model keeps this rank's
    tensor-parallel shard, whatever layout the checkpoint was saved in.
    """
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
    if tp_mesh is not None:
        from mg.generate_server.tensor_parallel import shard_for_serving

        model = shard_for_serving(model, tp_mesh)
    return LoadedModel(model, config, tokenizer, tokenizer_config, Path(load).resolve().name)
