"""Small random-init checkpoints whose greedy tokens are stable, for serving parity tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from mg.core.checkpoint import save_model
from mg.core.fixtures import gpt2_bpe_tokenizer_config
from mg.core.models import GPTModel, TransformerConfig, presets


def save_decisive_model(
    folder: Path,
    shape: Callable[..., TransformerConfig] = presets.tiny_llama,
    positions: int = 64,
    name: str = "ckpt",
    **overrides: Any,
) -> Path:
    """A model of `shape` seeded with 0, GPT-2's vocabulary padded to 50,304, weights drawn
    with std 0.3 (decisive logits: no near-ties for argmax to flip on between two
    implementations' rounding), no dropout, saved with GPT-2's tokenizer as folder/name."""
    torch.manual_seed(0)
    config = shape(
        **{
            "vocab_size": 50304,
            "max_position_embeddings": positions,
            "seq_length": positions,
            "init_method_std": 0.3,
            "hidden_dropout": 0.0,
            "attention_dropout": 0.0,
            **overrides,
        }
    )
    save_model(folder / name, GPTModel(config).eval(), config, gpt2_bpe_tokenizer_config())
    return folder / name
