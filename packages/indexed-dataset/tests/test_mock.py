"""The `--mock-data` corpus and datasets (Megatron's MockGPTLowLevelDataset, regenerated)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mg.indexed_dataset.gpt_dataset import GPTDatasetConfig
from mg.indexed_dataset.mock import MockGPTDataset, MockTokenSource, build_mock_gpt_datasets

EOD = 3


def test_mock_corpus_shape() -> None:
    source = MockTokenSource(vocab_size=1000, eod_token_id=EOD)
    assert len(source) == 100_000
    lengths = source.sequence_lengths
    assert lengths.dtype == np.int32 and lengths.min() >= 1 and lengths.max() < 4096
    expected = np.random.default_rng(0).integers(1, 4096, size=100_000, dtype=np.int32)
    np.testing.assert_array_equal(lengths, expected)


def test_mock_document_content_and_slices() -> None:
    source = MockTokenSource(vocab_size=10, eod_token_id=EOD)
    length = int(source.sequence_lengths[0])
    document = source[0]
    assert document.dtype == np.int64 and document.size == length
    np.testing.assert_array_equal(document[:-1], (np.arange(1, length)) % 10)
    assert document[-1] == EOD
    np.testing.assert_array_equal(source.get(0, offset=2, length=5), document[2:7])
    np.testing.assert_array_equal(source.get(0, offset=length - 2), document[-2:])
    np.testing.assert_array_equal(source.get(0, offset=length - 2, length=50), document[-2:])


def test_mock_datasets_split_one_one_one(tmp_path: Path) -> None:
    config = GPTDatasetConfig(seq_length=64, eod_token_id=EOD, split="99,1,0")
    train, valid, test = build_mock_gpt_datasets([100, 20, 20], config, vocab_size=500)
    assert all(isinstance(d, MockGPTDataset) for d in (train, valid, test))
    assert np.unique(train.document_index).tolist() == list(range(33_333))
    assert np.unique(test.document_index).tolist() == list(range(66_667, 100_000))
    sample = valid[0]
    assert sample["tokens"].shape == (64,) and sample["loss_mask"].all()
    assert sample["tokens"].max() < 500


def test_mock_is_not_cached_unless_asked(tmp_path: Path) -> None:
    config = GPTDatasetConfig(seq_length=64, eod_token_id=EOD)
    build_mock_gpt_datasets([10, 10, 10], config, vocab_size=500)
    cached = GPTDatasetConfig(seq_length=64, eod_token_id=EOD, path_to_cache=str(tmp_path))
    train, _, _ = build_mock_gpt_datasets([10, 10, 10], cached, vocab_size=500)
    names = [p.name for p in tmp_path.iterdir()]
    assert f"{train.unique_description_hash}-MockGPTDataset-train-sample_index.npy" in names


def test_mock_needs_eod() -> None:
    with pytest.raises(ValueError, match="eod_token_id"):
        build_mock_gpt_datasets([1, 1, 1], GPTDatasetConfig(seq_length=8), vocab_size=10)
