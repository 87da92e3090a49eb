"""A checkpoint folder in, a model and its tokenizer out, ready to serve."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from mg.core.checkpoint import CheckpointError, load_model
from mg.core.checkpoint.model_part import load_model_part
from mg.core.checkpoint.reader_guard import user_message
from mg.core.models import GPTModel, TransformerConfig
from mg.core.models.mamba import MambaModel
from mg.core.models.vision.llava import LLaVAModel
from mg.core.models.vocab_mask import set_real_vocab_size, unpadded_vocab_size
from mg.core.parallel.layout import ParallelLayout
from mg.core.parallel.tensor_parallel import TensorParallelError
from mg.core.tokenizers import BaseTokenizer, TokenizerConfig, build_tokenizer
from mg.generate_server.errors import ServeSetupError
from mg.generate_server.vlm_loading import is_vlm_checkpoint, load_vlm


@dataclass
class LoadedModel:
    model: GPTModel | MambaModel
    config: TransformerConfig
    tokenizer: BaseTokenizer
    tokenizer_config: TokenizerConfig
    name: str
    """What /v1/models and responses call the model: the checkpoint folder's name."""
    vlm: LLaVAModel | None = None
    """A vision-language checkpoint's whole model (`model` is its language model)."""


def load_for_serving(
    load: str | Path,
    device: str = "cpu",
    dtype: str | None = None,
    iteration: str | int | None = None,
    layout: ParallelLayout | None = None,
) -> LoadedModel:
    """Rebuild the checkpoint's model and tokenizer from its own metadata (no model flags).

    With a tensor-parallel `layout` (every rank of it calls this) each rank
    reads only its shard of the weights, whatever layout the checkpoint was
    saved in (core's `load_model_part`).
    """
    if isinstance(iteration, str) and iteration.isdigit():
        iteration = int(iteration)
    torch_dtype = getattr(torch, dtype) if dtype is not None else None
    vlm = None
    try:
        if is_vlm_checkpoint(load, iteration):
            if layout is not None and layout.tp > 1:
                raise ServeSetupError(
                    f"--tensor-model-parallel-size {layout.tp}: {load} is a vision-language "
                    "model, served on one process only for now; use "
                    "--tensor-model-parallel-size 1"
                )
            vlm, vlm_config, tokenizer_config = load_vlm(load, iteration)
            if torch_dtype is not None:
                vlm = vlm.to(torch_dtype)
            vlm = vlm.to(device).eval()
            model, config = vlm.language_model, vlm_config.language
        elif layout is not None and layout.tp > 1:
            part = load_model_part(load, layout, iteration, device=device, dtype=torch_dtype)
            model, config, tokenizer_config = part.module, part.config, part.tokenizer_config
            if isinstance(model, MambaModel):  # its recurrent state per TP rank: not yet
                raise ServeSetupError(
                    f"--tensor-model-parallel-size {layout.tp}: {load} is a Mamba / hybrid "
                    "model, served on one process only for now; use "
                    "--tensor-model-parallel-size 1"
                )
        else:
            model, config, tokenizer_config, _info = load_model(load, iteration)
            if torch_dtype is not None:
                model = model.to(torch_dtype)
            model = model.to(device).eval()
    except CheckpointError as exc:
        message = user_message(exc, "--ckpt-step N")
        raise ServeSetupError(message.replace("pass iteration=N", "pass --ckpt-step N")) from None
    except TensorParallelError as err:
        raise ServeSetupError(f"cannot serve with tensor parallelism: {err}") from None
    if tokenizer_config is None:
        raise ServeSetupError(
            f"{load} records no tokenizer; a server needs one to turn text into tokens. "
            "Re-save it with mg-train --tokenizer-type ... or import it with mg-convert."
        )
    try:
        tokenizer = build_tokenizer(tokenizer_config)
    except ValueError as exc:
        raise ServeSetupError(f"{load}: its tokenizer cannot be built: {exc}") from None
    # Megatron's padding rows are never sampled
    set_real_vocab_size(model, unpadded_vocab_size(config, tokenizer.vocab_size))
    name = Path(load).resolve().name
    return LoadedModel(model, config, tokenizer, tokenizer_config, name, vlm)
