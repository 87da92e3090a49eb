"""Blending datasets by weight: proportions, ordering, the cache and its errors."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mg.indexed_dataset.blended import BlendedDataset


class Numbers:
    """A stand-in mid-level dataset: sample i is {"value": [tag, i]}."""

    def __init__(self, tag: int, length: int) -> None:
        self.tag = tag
        self.length = length
        self.unique_identifiers: dict[str, Any] = {"class": "Numbers", "tag": tag, "len": length}

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        if not 0 <= idx < self.length:
            raise IndexError(idx)
        return {"value": np.array([self.tag, idx])}


def test_weights_are_followed_in_every_prefix() -> None:
    blend = BlendedDataset([Numbers(0, 500), Numbers(1, 700)], [1.0, 3.0], 800)
    assert len(blend) == 800
    counts = np.cumsum(np.eye(2)[np.asarray(blend.dataset_index)], axis=0)
    steps = np.arange(1, 801)[:, None]
    # greedy blending: no prefix is ever more than about one sample off the weights
    assert np.abs(counts - steps * np.array([0.25, 0.75])).max() <= 1.0


def test_samples_come_in_order_from_each_dataset() -> None:
    blend = BlendedDataset([Numbers(7, 100), Numbers(8, 100)], [0.5, 0.5], 60)
    seen: dict[int, list[int]] = {7: [], 8: []}
    for i in range(len(blend)):
        sample = blend[i]
        tag, index = sample["value"].tolist()
        assert sample["dataset_id"] == tag - 7
        seen[tag].append(index)
    assert seen[7] == list(range(30)) and seen[8] == list(range(30))


def test_exhaustive_blend_uses_every_sample_once() -> None:
    blend = BlendedDataset([Numbers(0, 30), Numbers(1, 70)], [30, 70], None)
    assert len(blend) == 100
    for d, size in enumerate((30, 70)):
        picked = np.asarray(blend.dataset_sample_index)[np.asarray(blend.dataset_index) == d]
        assert picked.tolist() == list(range(size))


def test_oversampling_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"takes 75 samples from dataset 1 .* only 10"):
        BlendedDataset([Numbers(0, 100), Numbers(1, 10)], [0.25, 0.75], 100)


@pytest.mark.parametrize(
    ("weights", "size", "message"),
    [
        ([1.0, -1.0], 10, "must be > 0"),
        ([1.0, 0.0], 10, "must be > 0"),
        ([1.0], 10, "2 datasets but 1 weights"),
        ([0.5, 1.5], None, "whole sample counts"),
    ],
)
def test_bad_weights(weights: list[float], size: int | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BlendedDataset([Numbers(0, 100), Numbers(1, 100)], weights, size)


def test_blend_indices_are_cached(tmp_path: Path) -> None:
    parts = [Numbers(0, 1000), Numbers(1, 1000)]
    first = BlendedDataset(parts, [0.4, 0.6], 1000, split="valid", cache_dir=str(tmp_path))
    names = sorted(os.listdir(tmp_path))
    md5 = first.unique_description_hash
    assert names == [
        f"{md5}-BlendedDataset-valid-dataset_index.npy",
        f"{md5}-BlendedDataset-valid-dataset_sample_index.npy",
        f"{md5}-BlendedDataset-valid-description.txt",
    ]
    second = BlendedDataset(parts, [0.4, 0.6], 1000, split="valid", cache_dir=str(tmp_path))
    assert isinstance(second.dataset_index, np.memmap)
    np.testing.assert_array_equal(second.dataset_index, first.dataset_index)
    other = BlendedDataset(parts, [0.5, 0.5], 1000, split="valid", cache_dir=str(tmp_path))
    assert other.unique_description_hash != md5
