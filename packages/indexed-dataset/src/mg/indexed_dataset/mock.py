"""`--mock-data`: Megatron's synthetic corpus, for runs and tests without a dataset.

The corpus is Megatron-Core's `MockGPTLowLevelDataset`, number for number:
100,000 documents with lengths drawn by `numpy.random.default_rng(0)` from
[1, 4096), document i of length L holding the tokens `1, 2, ..., L-1` (mod
the vocabulary size) followed by the end-of-document token. Split "1,1,1"
(Megatron's fixed split for mock data), the samples are Megatron's too.
"""

from __future__ import annotations

import numpy as np

from mg.indexed_dataset.gpt_dataset import GPTDataset, GPTDatasetConfig
from mg.indexed_dataset.split import Split, parse_split, split_matrix, split_range

MOCK_SPLIT = "1,1,1"
"""Megatron replaces any `--split` by an even split when the data is mocked."""


class MockTokenSource:
    """The synthetic documents, generated on read: nothing is stored but their lengths."""

    seed: int = 0
    size: int = 100_000
    max_sequence_length: int = 4096

    def __init__(self, vocab_size: int, eod_token_id: int) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.vocab_size = vocab_size
        self.eod_token_id = eod_token_id
        rng = np.random.default_rng(seed=self.seed)
        self.sequence_lengths = rng.integers(
            low=1, high=self.max_sequence_length, size=self.size, dtype=np.int32
        )

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> np.ndarray:
        return self.get(idx)

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens `offset .. offset + length` of document `idx` (clipped to it), int64."""
        document_length = int(self.sequence_lengths[idx])
        end = document_length if length is None else min(offset + length, document_length)
        positions = np.arange(offset, max(end, offset), dtype=np.int64)
        tokens = (positions + 1) % self.vocab_size
        tokens[positions == document_length - 1] = self.eod_token_id
        return tokens


class MockGPTDataset(GPTDataset):
    """A `GPTDataset` over `MockTokenSource`; its own class name keeps its cache files apart."""


def build_mock_gpt_datasets(
    num_samples: tuple[int | None, int | None, int | None] | list[int | None],
    config: GPTDatasetConfig,
    vocab_size: int,
) -> tuple[MockGPTDataset | None, MockGPTDataset | None, MockGPTDataset | None]:
    """Train, valid and test mock datasets over the 100,000 synthetic documents.

    `config.split` is ignored for Megatron's "1,1,1"; the indices are cached
    only when `config.path_to_cache` is set.
    """
    if config.eod_token_id is None:
        raise ValueError("the mock dataset needs eod_token_id: it ends every document with it")
    if len(num_samples) != len(Split):
        raise ValueError(f"num_samples needs 3 entries (train, valid, test), got {num_samples}")
    source = MockTokenSource(vocab_size, config.eod_token_id)
    datasets: list[MockGPTDataset | None] = []
    for split, bookends in zip(Split, split_matrix(parse_split(MOCK_SPLIT)), strict=True):
        if bookends is None:
            datasets.append(None)
            continue
        datasets.append(
            MockGPTDataset(
                source,
                split_range(bookends, len(source)),
                num_samples[split.value],
                config,
                split,
            )
        )
    return datasets[0], datasets[1], datasets[2]
