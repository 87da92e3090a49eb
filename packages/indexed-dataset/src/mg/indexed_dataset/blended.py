"""Several datasets as one, mixed by weight with Megatron's greedy blend.

Sample i of a `BlendedDataset` is sample `dataset_sample_index[i]` of dataset
`dataset_index[i]`; the two arrays are Megatron-Core's (`blended_dataset.py`),
element for element, and cached like the GPT indices.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from mg.indexed_dataset.indices import (
    build_blending_indices,
    build_exhaustive_blending_indices,
    cached_indices,
)

logger = logging.getLogger(__name__)

_INDEX_NAMES = ("dataset_index", "dataset_sample_index")


class BlendableDataset(Protocol):
    """A dataset a blend can draw from: sized, indexable, with identifiers for the cache key."""

    unique_identifiers: dict[str, Any]

    def __len__(self) -> int: ...

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]: ...


class BlendedDataset:
    """Datasets mixed in proportion to their weights.

    With a `size`, the weights are normalised and the blend has exactly `size`
    samples, drawn greedily so that every prefix of the blend is as close to
    the weights as it can be. With `size=None` the weights must be sample
    counts and every counted sample is used once (Megatron's exhaustive blend).
    `ds[i]` is the chosen dataset's sample plus `dataset_id`.
    """

    def __init__(
        self,
        datasets: Sequence[BlendableDataset],
        weights: Sequence[float],
        size: int | None,
        *,
        split: str = "train",
        cache_dir: str | None = None,
    ) -> None:
        if not datasets:
            raise ValueError("a blend needs at least one dataset")
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        if any(not np.isfinite(w) or w <= 0 for w in weights):
            raise ValueError(f"blend weights must be > 0, got {list(weights)}")
        if size is None and any(float(w) != int(w) for w in weights):
            raise ValueError("a blend without a size needs whole sample counts as weights")
        if len(datasets) == 1:
            logger.warning("blending a single dataset (a weight was given for one prefix)")
        self.datasets = list(datasets)
        self.split = split
        self.size = size
        if size is None:
            self.weights: list[float] = [int(w) for w in weights]
        else:
            normalized = np.asarray(weights, dtype=np.float64)
            self.weights = (normalized / normalized.sum()).tolist()

        self.unique_identifiers: dict[str, Any] = {
            "class": type(self).__name__,
            "datasets": [dataset.unique_identifiers for dataset in self.datasets],
            "split": split,
            "weights": self.weights,
            "size": size,
        }
        self.unique_description = json.dumps(self.unique_identifiers, indent=4)
        self.unique_description_hash = hashlib.md5(
            self.unique_description.encode("utf-8"), usedforsecurity=False
        ).hexdigest()
        arrays = cached_indices(
            cache_dir,
            f"{self.unique_description_hash}-{type(self).__name__}-{split}",
            self.unique_description,
            _INDEX_NAMES,
            self._build_indices,
        )
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]

    def _build_indices(self) -> dict[str, np.ndarray]:
        if self.size is None:
            dataset_index, sample_index = build_exhaustive_blending_indices(self.weights)
        else:
            dataset_index, sample_index = build_blending_indices(self.weights, self.size)
        self._check_not_oversampled(dataset_index)
        return {"dataset_index": dataset_index, "dataset_sample_index": sample_index}

    def _check_not_oversampled(self, dataset_index: np.ndarray) -> None:
        """Every dataset must hold the samples the blend takes from it."""
        taken = np.bincount(dataset_index, minlength=len(self.datasets))
        for number, (dataset, count) in enumerate(zip(self.datasets, taken, strict=True)):
            if count > len(dataset):
                raise ValueError(
                    f"the {self.split} blend takes {count} samples from dataset {number} "
                    f"({getattr(dataset, 'dataset_path', type(dataset).__name__)}), which has "
                    f"only {len(dataset)}; build the datasets with more samples to spare "
                    f"(GPTDatasetConfig.mid_level_dataset_surplus, default 0.005)"
                )

    def __len__(self) -> int:
        return self.dataset_index.shape[0]

    def __getitem__(self, idx: int) -> dict[str, Any]:
        dataset_id = int(self.dataset_index[idx])
        sample = self.datasets[dataset_id][int(self.dataset_sample_index[idx])]
        return {"dataset_id": dataset_id, **sample}

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({len(self.datasets)} datasets, split={self.split}, "
            f"samples={len(self)})"
        )
