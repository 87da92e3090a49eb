"""Checkpoint → (model, tokenizer), for every mg-eval task, on core's ``load_model``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mg.core.checkpoint.model_io import load_model
from mg.core.models import GPTModel, TransformerConfig
from mg.core.tokenizers import TokenizerConfig, build_tokenizer
from mg.core.tokenizers.base import BaseTokenizer
from mg.evaluate.errors import EvalInputError

TOKENIZER_FIELDS = ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model")


@dataclass
class LoadedModel:
    model: GPTModel
    config: TransformerConfig
    tokenizer: BaseTokenizer
    iteration: Any


def load_for_eval(
    load_dir: str | Path,
    iteration: int | str | None = None,
    tokenizer_overrides: dict[str, Any] | None = None,
) -> LoadedModel:
    """The checkpoint's model in eval mode (fp32, CPU or the first GPU) and its tokenizer.

    ``tokenizer_overrides`` (from ``--tokenizer-type`` / ``--vocab-file`` / ...)
    replace the fields the checkpoint recorded; a checkpoint without a tokenizer
    needs ``--tokenizer-type`` and its files.
    """
    load_dir = Path(load_dir)
    if not load_dir.is_dir():
        raise EvalInputError("no such checkpoint folder (--load)", load_dir)
    model, config, tok_config, info = load_model(load_dir, iteration)
    overrides = {k: v for k, v in (tokenizer_overrides or {}).items() if v is not None}
    if tok_config is None:
        if "tokenizer_type" not in overrides:
            raise EvalInputError(
                "the checkpoint records no tokenizer; give --tokenizer-type and its files "
                "(--vocab-file/--merge-file or --tokenizer-model)",
                load_dir,
            )
        tok_config = TokenizerConfig(**overrides)
    elif overrides:
        tok_config = dataclasses.replace(tok_config, **overrides)
    _resolve_relative(tok_config, load_dir)
    try:
        tokenizer = build_tokenizer(tok_config)
    except (ValueError, OSError) as exc:
        raise EvalInputError(f"cannot build the tokenizer: {exc}") from None
    if tokenizer.vocab_size > config.vocab_size:
        raise EvalInputError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model only "
            f"{config.vocab_size}; wrong --tokenizer-type/--vocab-file?"
        )
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = model.to(device=device, dtype=torch.float32).eval()
    return LoadedModel(model, config, tokenizer, info.iteration)


def _resolve_relative(config: TokenizerConfig, root: Path) -> None:
    """Paths recorded relative to the checkpoint folder (what mg-convert writes) resolve there."""
    for name in ("vocab_file", "merge_file", "tokenizer_model"):
        value = getattr(config, name)
        if value and not Path(value).exists() and (root / value).exists():
            setattr(config, name, str(root / value))
