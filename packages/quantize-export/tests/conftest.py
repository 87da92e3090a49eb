"""A tiny Llama (GQA, SwiGLU, RMSNorm, untied) briefly trained on Botchan with the GPT-2
tokenizer, saved as an mg checkpoint, and calibration / held-out indexed datasets cut
from other parts of Botchan."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from mg.core.checkpoint import save_model
from mg.core.fixtures import fixture_path
from mg.core.models import GPTModel
from mg.core.models.presets import tiny_llama
from mg.core.testing.botchan_training import train_on_botchan
from mg.core.tokenizers import TokenizerConfig, build_tokenizer
from mg.indexed_dataset import IndexedDatasetBuilder

SEQ = 32


@pytest.fixture(scope="session")
def tokenizer_config() -> TokenizerConfig:
    return TokenizerConfig(
        "GPT2BPETokenizer",
        vocab_file=str(fixture_path("gpt2-bpe", "vocab.json")),
        merge_file=str(fixture_path("gpt2-bpe", "merges.txt")),
    )


@pytest.fixture(scope="session")
def tokenizer(tokenizer_config):
    return build_tokenizer(tokenizer_config)


@pytest.fixture(scope="session")
def trained_llama(tokenizer, tokenizer_config, tmp_path_factory) -> tuple[GPTModel, Path]:
    torch.manual_seed(0)
    config = tiny_llama(
        vocab_size=50304, ffn_hidden_size=128, seq_length=SEQ, max_position_embeddings=SEQ
    )
    model = train_on_botchan(
        GPTModel(config), tokenizer, steps=30, window=SEQ, batch_size=4, text_end=60000
    )
    folder = tmp_path_factory.mktemp("llama")
    save_model(folder, model, config, tokenizer_config)
    return model, folder


def _dataset(folder: Path, name: str, tokenizer, start: int, end: int) -> str:
    text = fixture_path("botchan", "botchan.txt").read_text(encoding="utf-8")[start:end]
    prefix = folder / name
    with IndexedDatasetBuilder(f"{prefix}.bin", np.int32) as builder:
        for k in range(0, len(text), 2000):
            ids = tokenizer.tokenize(text[k : k + 2000])
            builder.add_document(ids, [len(ids)])
        builder.finalize(f"{prefix}.idx")
    return str(prefix)


@pytest.fixture(scope="session")
def datasets(tokenizer, tmp_path_factory) -> tuple[str, str]:
    """(calibration prefix, held-out prefix)."""
    folder = tmp_path_factory.mktemp("data")
    return (
        _dataset(folder, "calib", tokenizer, 60000, 80000),
        _dataset(folder, "heldout", tokenizer, 100000, 120000),
    )
