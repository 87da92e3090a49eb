"""Megatron's `BlendedMegatronDatasetBuilder`, for any per-prefix dataset class.

A blend (`--data-path w1 P1 w2 P2 ...` or a blend file) becomes one dataset
per split: each prefix is split by `--split`, every prefix's split dataset is
asked for its share of the samples (`ceil(ceil(target * w) * (1 + surplus))`,
Megatron's over-request), and the shares are mixed by `BlendedDataset`. Only
the per-prefix datasets differ between GPT, BERT and T5, so the builder takes
them as a callable: `splits_of(prefix, bookends, num_samples)` returns one
dataset (or None) per split.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from typing import Any

from mg.indexed_dataset.blended import BlendedDataset
from mg.indexed_dataset.split import Blend, Split, parse_data_path

SplitsOf = Callable[[str, Sequence[tuple[float, float] | None], Sequence[int | None]], list[Any]]
"""(prefix, per-split bookends, per-split sample counts) -> one dataset or None per split."""


def as_blend(blend: Blend | Sequence[str] | str) -> Blend:
    """A `Blend` from itself or from `--data-path` words."""
    return blend if isinstance(blend, Blend) else parse_data_path(blend)


def samples_per_dataset(
    weights: Sequence[float], num_samples: Sequence[int | None], surplus: float
) -> list[list[int | None]]:
    """Megatron's per-dataset requests: `ceil(ceil(target * w) * (1 + surplus))` per split."""
    return [
        [
            None if target is None else int(math.ceil(math.ceil(target * weight) * (1 + surplus)))
            for target in num_samples
        ]
        for weight in weights
    ]


class BlendBuilder:
    """Builds the splits of a blend from per-prefix split datasets."""

    def __init__(self, splits_of: SplitsOf, *, surplus: float, cache_dir: str | None) -> None:
        self.splits_of = splits_of
        self.surplus = surplus
        self.cache_dir = cache_dir

    def blend_split(
        self,
        blend: Blend,
        bookends: Sequence[tuple[float, float] | None],
        num_samples: Sequence[int | None],
    ) -> list[Any]:
        """All splits of a blend that share one split string (Megatron's `blend` case)."""
        if len(blend.prefixes) == 1 and blend.weights is None:
            return list(self.splits_of(blend.prefixes[0], bookends, num_samples))
        weights = blend.normalized_weights()
        if weights is None:
            per_dataset = [[None] * len(Split) for _ in blend.prefixes]
        else:
            targets = samples_per_dataset(weights, num_samples, 0.0)
            per_dataset = samples_per_dataset(weights, num_samples, self.surplus)
        by_prefix = [
            self.splits_of(prefix, bookends, sizes)
            for prefix, sizes in zip(blend.prefixes, per_dataset, strict=True)
        ]
        blended: list[Any] = []
        for split in Split:
            if bookends[split.value] is None:
                blended.append(None)
                continue
            parts = [datasets[split.value] for datasets in by_prefix]
            if any(part is None for part in parts):  # a prefix without this split: none to mix
                blended.append(None)
                continue
            requested = num_samples[split.value]
            if weights is not None:
                if requested is None:
                    raise ValueError(
                        f"the {split.name} split of a weighted blend needs a sample count"
                    )
                split_weights = weights
                size: int | None = sum(target[split.value] for target in targets)
            else:
                split_weights = [float(len(part)) for part in parts]
                for prefix, weight in zip(blend.prefixes, split_weights, strict=True):
                    if weight == 0:
                        raise ValueError(
                            f"{prefix}: its {split.name} split holds no complete sample, so it "
                            f"cannot be blended by size; give weights, or change --split"
                        )
                size = None if requested is None else min(requested, int(sum(split_weights)))
            blended.append(
                BlendedDataset(
                    parts,
                    split_weights,
                    size,
                    split=split.name,
                    cache_dir=self._blend_cache_dir(blend),
                )
            )
        return blended

    def _blend_cache_dir(self, blend: Blend) -> str:
        if self.cache_dir is not None:
            return self.cache_dir
        return os.path.join(blend.prefixes[0], "cache", "BlendedDataset_indices")
