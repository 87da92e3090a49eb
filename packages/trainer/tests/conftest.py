"""Shared helpers: a tiny GPT's flags, an in-process run, and a real corpus (Botchan, GPT-2 BPE)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from mg.trainer.arguments import parse_args
from mg.trainer.training import Trainer, TrainResult

TINY = [
    "gpt",
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--max-position-embeddings",
    "32",
    "--lr",
    "1e-3",
    "--min-lr",
    "1e-4",
    "--lr-decay-style",
    "cosine",
    "--lr-warmup-iters",
    "2",
    "--log-interval",
    "1000",
    "--eval-iters",
    "0",
    "--seed",
    "1234",
]


def _mock_argv(
    tmp_path: Path, *extra: str, mbs: int = 4, gbs: int = 8, iters: int = 10
) -> list[str]:
    """A tiny GPT on mock data (NullTokenizer, 127 ids)."""
    return [
        *TINY,
        "--mock-data",
        "--vocab-size",
        "127",
        "--data-cache-path",
        str(tmp_path / "cache"),
        "--micro-batch-size",
        str(mbs),
        "--global-batch-size",
        str(gbs),
        "--train-iters",
        str(iters),
        *extra,
    ]


def _train(argv: list[str], world_size: int = 1, **kwargs) -> TrainResult:
    return Trainer(parse_args(argv, world_size=world_size)).train(**kwargs)


@pytest.fixture(autouse=True)
def _restore_torch_globals():
    deterministic = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(deterministic)


@pytest.fixture(scope="session")
def botchan_corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[str]]:
    """Botchan as an indexed dataset (one paragraph per document, EOD appended).

    Returns the prefix and the tokenizer flags.
    """
    from mg.core.fixtures import fixture_path
    from mg.core.tokenizers import TokenizerConfig, build_tokenizer
    from mg.indexed_dataset import IndexedDatasetBuilder

    vocab = fixture_path("gpt2-bpe", "vocab.json")
    merges = fixture_path("gpt2-bpe", "merges.txt")
    tok = build_tokenizer(TokenizerConfig("GPT2BPETokenizer", str(vocab), str(merges)))
    text = fixture_path("botchan", "botchan.txt").read_text("utf-8")
    lines = [line.strip() for line in text.splitlines() if line.strip()][:2000]
    paragraphs = [" ".join(lines[i : i + 10]) for i in range(0, len(lines), 10)]
    folder = tmp_path_factory.mktemp("botchan")
    prefix = str(folder / "botchan_text_document")
    with IndexedDatasetBuilder(prefix + ".bin", np.uint16) as builder:
        for paragraph in paragraphs:
            ids = tok.tokenize(paragraph) + [tok.eod]
            builder.add_document(ids, [len(ids)])
        builder.finalize(prefix + ".idx")
    flags = [
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        str(vocab),
        "--merge-file",
        str(merges),
    ]
    return prefix, flags


@pytest.fixture
def mock_argv():
    """`mock_argv(tmp_path, *flags, mbs=, gbs=, iters=)` -> argv of a tiny mock-data GPT run."""
    return _mock_argv


@pytest.fixture
def train():
    """`train(argv, **train_kwargs)` -> TrainResult, in this process."""
    return _train
