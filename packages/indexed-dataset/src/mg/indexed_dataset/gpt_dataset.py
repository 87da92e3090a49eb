"""GPT training samples: fixed-length token windows over shuffled documents, as Megatron-Core.

A `GPTDataset` exposes one split (a range of sequences of an indexed
dataset) as `num_samples` or more samples of `seq_length + 1` tokens, drawn
through the document, sample and shuffle indices of `indices.py`, which are
cached on disk. Sample k of ours is sample k of Megatron-Core's for the same
data, seed, sequence length and split; `build_gpt_datasets` reproduces
Megatron's `BlendedMegatronDatasetBuilder` on top, blends included.

Everything is numpy; torch is touched only to wait at a barrier while rank 0
builds the indices, and only if the caller has initialised torch.distributed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from mg.indexed_dataset.blend_builder import BlendBuilder, as_blend
from mg.indexed_dataset.blended import BlendedDataset
from mg.indexed_dataset.format import IndexedDataset
from mg.indexed_dataset.indices import build_gpt_indices, cached_indices
from mg.indexed_dataset.split import (
    DEFAULT_SPLIT,
    Blend,
    Split,
    check_prefixes_exist,
    parse_split,
    split_matrix,
    split_range,
)

logger = logging.getLogger(__name__)

PAD_TOKEN_ID_UNSET = -1
"""Megatron's stand-in pad id when the tokenizer has none: no real token can equal it."""

_INDEX_NAMES = ("document_index", "sample_index", "shuffle_index")


@runtime_checkable
class TokenSource(Protocol):
    """What a GPT dataset reads tokens from: an `IndexedDataset` or the mock corpus."""

    @property
    def sequence_lengths(self) -> np.ndarray: ...

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray: ...


@dataclass(frozen=True)
class GPTDatasetConfig:
    """How samples are cut and what comes with them (Megatron's `GPTDatasetConfig`).

    Only `seq_length`, `seed`, `split`, `add_extra_token_to_sequence` and
    `drop_last_partial_validation_sequence` change which tokens a sample
    holds; the rest shapes the masks.
    """

    seq_length: int
    """Tokens per sample fed to the model (`--seq-length`)."""
    seed: int = 1234
    """Seed of the shuffles (`--seed`)."""
    split: str = DEFAULT_SPLIT
    """Train/valid/test weights over the sequences of each dataset (`--split`)."""
    path_to_cache: str | None = None
    """Where the index files go (`--data-cache-path`); default: `<prefix>/cache/...`."""
    eod_token_id: int | None = None
    """End-of-document token; needed by `eod_mask_loss` and the two resets."""
    pad_token_id: int | None = None
    """Pad token; None (or one equal to eod) means no pad, as in Megatron."""
    reset_position_ids: bool = False
    """Restart position ids after every end-of-document token."""
    reset_attention_mask: bool = False
    """Stop attention across end-of-document tokens (needs `create_attention_mask`)."""
    eod_mask_loss: bool = False
    """No loss on end-of-document tokens."""
    create_attention_mask: bool = False
    """Return a `[1, S, S]` bool mask (True = masked); kernels usually make their own."""
    add_extra_token_to_sequence: bool = True
    """Read `seq_length + 1` tokens so inputs and labels both have `seq_length`."""
    drop_last_partial_validation_sequence: bool = True
    """Drop the last incomplete validation sample instead of padding it."""
    mid_level_dataset_surplus: float = 0.005
    """Extra fraction of samples each blended dataset builds beyond its share."""
    mmap_bin_files: bool = True
    """Memory-map the `.bin` files (else positional reads)."""

    def __post_init__(self) -> None:
        if self.seq_length < 1:
            raise ValueError(f"seq_length must be >= 1, got {self.seq_length}")
        parse_split(self.split)  # fail here, not after the first dataset is opened
        needs_eod = [
            name
            for name in ("eod_mask_loss", "reset_position_ids", "reset_attention_mask")
            if getattr(self, name)
        ]
        if needs_eod and self.eod_token_id is None:
            raise ValueError(f"{', '.join(needs_eod)} need eod_token_id")
        if self.mid_level_dataset_surplus < 0:
            raise ValueError("mid_level_dataset_surplus must be >= 0")

    @property
    def extra_tokens(self) -> int:
        return int(self.add_extra_token_to_sequence)


def _resolve_pad_token_id(config: GPTDatasetConfig) -> int:
    """The pad id samples are padded with; Megatron's rule for a pad equal to eod.

    A pad id that is also the eod id would mask the loss on every real eod, so
    Megatron falls back to -1 (no pad) and warns; so do we.
    """
    if config.pad_token_id is None:
        return PAD_TOKEN_ID_UNSET
    if config.pad_token_id == config.eod_token_id:
        warnings.warn(
            f"pad token id {config.pad_token_id} is also the eod token id; padding with -1 "
            f"instead so that real end-of-document tokens keep their loss (as Megatron does)",
            stacklevel=3,
        )
        return PAD_TOKEN_ID_UNSET
    return config.pad_token_id


def _split_of(split: Split | str) -> Split:
    if isinstance(split, Split):
        return split
    try:
        return Split[split]
    except KeyError:
        raise ValueError(f"unknown split {split!r}; expected train, valid or test") from None


class GPTDataset:
    """One split of one indexed dataset as GPT samples.

    `ds[k]` is a dict of numpy arrays: `tokens`, `labels` (int64, `[S]`),
    `loss_mask` (float32), `position_ids` (int64) and, if configured,
    `attention_mask` (bool `[1, S, S]`, True where attention is masked).
    `ds[None]` is an all-padding-loss sample for padding a batch, as in Megatron.
    Its length is the number of samples in the index, which is at least
    `num_samples`.
    """

    def __init__(
        self,
        indexed: TokenSource,
        document_ids: np.ndarray,
        num_samples: int | None,
        config: GPTDatasetConfig,
        split: Split | str = Split.train,
        *,
        dataset_path: str | None = None,
    ) -> None:
        self.indexed = indexed
        self.document_ids = np.asarray(document_ids, dtype=np.int32)
        self.num_samples = num_samples
        self.config = config
        self.split = _split_of(split)
        self.dataset_path = dataset_path or getattr(indexed, "path_prefix", None)
        self.pad_token_id = _resolve_pad_token_id(config)
        self.drop_last_partial_sequence = (
            self.split != Split.valid or config.drop_last_partial_validation_sequence
        )
        if num_samples is not None and num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")

        self.unique_identifiers = self._identifiers()
        self.unique_description = json.dumps(self.unique_identifiers, indent=4)
        self.unique_description_hash = hashlib.md5(
            self.unique_description.encode("utf-8"), usedforsecurity=False
        ).hexdigest()
        arrays = cached_indices(
            self._cache_dir(),
            f"{self.unique_description_hash}-{type(self).__name__}-{self.split.name}",
            self.unique_description,
            _INDEX_NAMES,
            self._build_indices,
        )
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]

    # --- identity and cache --------------------------------------------------------------------

    def _identifiers(self) -> dict[str, Any]:
        """Everything the indices depend on; its md5 names the cache files.

        Unlike Megatron's, it holds the split's actual documents (their count
        and a hash) and the dataset's sequence count instead of the tokenizer,
        so that a dataset rewritten under the same prefix does not pick up
        stale indices.
        """
        return {
            "class": type(self).__name__,
            "dataset_path": self.dataset_path,
            "num_sequences": int(len(self.indexed.sequence_lengths)),
            "split": self.split.name,
            "num_documents": int(self.document_ids.size),
            "documents_md5": hashlib.md5(
                self.document_ids.tobytes(), usedforsecurity=False
            ).hexdigest(),
            "num_samples": self.num_samples,
            "seed": self.config.seed,
            "seq_length": self.config.seq_length,
            "add_extra_token_to_sequence": self.config.add_extra_token_to_sequence,
            "drop_last_partial_sequence": self.drop_last_partial_sequence,
        }

    def _cache_dir(self) -> str | None:
        """`path_to_cache`, else Megatron's `<prefix>/cache/GPTDataset_indices`; None for mocks."""
        if self.config.path_to_cache is not None:
            return self.config.path_to_cache
        if self.dataset_path is None:
            return None
        return os.path.join(self.dataset_path, "cache", f"{type(self).__name__}_indices")

    def _build_indices(self) -> dict[str, np.ndarray]:
        indices = build_gpt_indices(
            np.asarray(self.indexed.sequence_lengths),
            self.document_ids,
            self.num_samples,
            self.config.seq_length,
            self.config.seed,
            self.config.add_extra_token_to_sequence,
            self.drop_last_partial_sequence,
        )
        logger.info(
            "%s %s: %d samples from %d documents, %d epoch(s)%s",
            type(self).__name__,
            self.split.name,
            len(indices),
            self.document_ids.size,
            indices.num_epochs,
            ", last epoch shuffled separately" if indices.separate_final_epoch else "",
        )
        return {name: getattr(indices, name) for name in _INDEX_NAMES}

    # --- samples -------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def __getitem__(self, idx: int | None) -> dict[str, np.ndarray]:
        padding_sample = idx is None
        text = self.sample_tokens(0 if padding_sample else int(idx))
        if self.config.add_extra_token_to_sequence:
            tokens = text[:-1].copy()
            labels = text[1:].copy()
        else:
            tokens = text
            labels = np.roll(text, -1)
            labels[-1] = self.pad_token_id
        sample = self._masks_and_positions(tokens)
        # Padding: no loss on it, and token id 0 so that the embedding can look it up.
        pad = self.pad_token_id
        sample["loss_mask"][labels == pad] = 0.0
        tokens[tokens == pad] = 0
        labels[labels == pad] = 0
        if padding_sample:
            sample["loss_mask"][:] = 0.0
        return {"tokens": tokens, "labels": labels, **sample}

    def sample_tokens(self, idx: int) -> np.ndarray:
        """The `seq_length + extra` token ids of sample `idx`, padded with the pad id, int64."""
        if not -len(self) <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for {len(self)} samples")
        position = int(self.shuffle_index[idx])
        first_doc, first_offset = (int(v) for v in self.sample_index[position])
        last_doc, last_offset = (int(v) for v in self.sample_index[position + 1])
        extra = self.config.extra_tokens
        if first_doc == last_doc:
            parts = [
                self.indexed.get(
                    int(self.document_index[first_doc]),
                    offset=first_offset,
                    length=last_offset - first_offset + extra,
                )
            ]
        else:
            parts = [self.indexed.get(int(self.document_index[first_doc]), offset=first_offset)]
            parts += [
                self.indexed.get(int(d)) for d in self.document_index[first_doc + 1 : last_doc]
            ]
            parts.append(
                self.indexed.get(int(self.document_index[last_doc]), length=last_offset + extra)
            )
        wanted = self.config.seq_length + extra
        text = np.full(wanted, self.pad_token_id, dtype=np.int64)
        filled = 0
        for part in parts:
            text[filled : filled + len(part)] = part
            filled += len(part)
        return text

    def _masks_and_positions(self, tokens: np.ndarray) -> dict[str, np.ndarray]:
        """Loss mask, position ids and the optional attention mask, as Megatron makes them."""
        config = self.config
        length = tokens.shape[0]
        loss_mask = np.ones(length, dtype=np.float32)
        position_ids = np.arange(length, dtype=np.int64)
        is_eod = tokens == config.eod_token_id if config.eod_token_id is not None else None
        if config.eod_mask_loss and is_eod is not None:
            loss_mask[is_eod] = 0.0
        if config.reset_position_ids and is_eod is not None:
            # Positions restart after each eod: subtract where the current document began.
            document_start = np.zeros(length, dtype=np.int64)
            after_eod = np.flatnonzero(is_eod[:-1]) + 1
            document_start[after_eod] = after_eod
            position_ids -= np.maximum.accumulate(document_start)
        out = {"loss_mask": loss_mask, "position_ids": position_ids}
        if config.create_attention_mask:
            allowed = np.tri(length, dtype=bool)
            if config.reset_attention_mask and is_eod is not None:
                # Token j may attend to token i only if no eod lies in [i, j).
                document = np.concatenate(([0], np.cumsum(is_eod[:-1])))
                allowed &= document[:, None] == document[None, :]
            out["attention_mask"] = ~allowed[None]
        return out

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.dataset_path!r}, split={self.split.name}, "
            f"samples={len(self)}, seq_length={self.config.seq_length})"
        )


# --- building the three splits ----------------------------------------------------------------

Dataset = GPTDataset | BlendedDataset


def _open_indexed_dataset(path_prefix: str, config: GPTDatasetConfig) -> TokenSource:
    """Open a prefix with our MMIDIDX reader."""
    return IndexedDataset(path_prefix, multimodal=False, mmap=config.mmap_bin_files)


class _GPTSplits:
    """The GPT datasets of one prefix, one per split that has a share of its sequences."""

    def __init__(self, config: GPTDatasetConfig, dataset_class: type[GPTDataset]) -> None:
        self.config = config
        self.dataset_class = dataset_class
        self._opened: dict[str, TokenSource] = {}

    def source(self, prefix: str) -> TokenSource:
        if prefix not in self._opened:
            self._opened[prefix] = _open_indexed_dataset(prefix, self.config)
        return self._opened[prefix]

    def __call__(
        self,
        prefix: str,
        bookends: Sequence[tuple[float, float] | None],
        num_samples: Sequence[int | None],
    ) -> list[GPTDataset | None]:
        source = self.source(prefix)
        num_sequences = len(source.sequence_lengths)
        datasets: list[GPTDataset | None] = []
        for split, ends in zip(Split, bookends, strict=True):
            if ends is None:
                datasets.append(None)
                continue
            datasets.append(
                self.dataset_class(
                    source,
                    split_range(ends, num_sequences),
                    num_samples[split.value],
                    self.config,
                    split,
                    dataset_path=prefix,
                )
            )
        return datasets


def build_gpt_datasets(
    blend: Blend | Sequence[str] | str | None,
    num_samples: Sequence[int | None],
    config: GPTDatasetConfig,
    *,
    blend_per_split: Sequence[Blend | Sequence[str] | str | None] | None = None,
) -> tuple[Dataset | None, Dataset | None, Dataset | None]:
    """Train, valid and test datasets from `--data-path` (or per-split paths), as Megatron.

    `blend` is a `Blend` or the `--data-path` words (`P`, `w1 P1 w2 P2 ...`,
    `P1 P2 ...`), split by `config.split`. Alternatively `blend_per_split` gives
    each split its own blend (`--train-data-path`, `--valid-data-path`,
    `--test-data-path`), each used whole. `num_samples` are the sample counts
    of train, valid and test (`samples_per_split`); None builds one epoch.
    A split that gets no data is None.

    Call it on every rank when torch.distributed is initialised: rank 0 builds
    the index files while the others wait, then they load them.
    """
    if len(num_samples) != len(Split):
        raise ValueError(f"num_samples needs 3 entries (train, valid, test), got {num_samples}")
    builder = BlendBuilder(
        _GPTSplits(config, GPTDataset),
        surplus=config.mid_level_dataset_surplus,
        cache_dir=config.path_to_cache,
    )
    if blend_per_split is not None:
        if blend is not None:
            raise ValueError("give either a blend (--data-path) or per-split blends, not both")
        if len(blend_per_split) != len(Split):
            raise ValueError("blend_per_split needs 3 entries (train, valid, test)")
        blends = [None if b is None else as_blend(b) for b in blend_per_split]
        for split_blend in blends:
            if split_blend is not None:
                check_prefixes_exist(split_blend)
        datasets: list[Dataset | None] = []
        for split, split_blend in zip(Split, blends, strict=True):
            if split_blend is None:
                datasets.append(None)
                continue
            if len(split_blend.prefixes) == 1:
                split_blend = Blend(split_blend.prefixes)  # Megatron ignores a lone weight here
            bookends: list[tuple[float, float] | None] = [None] * len(Split)
            bookends[split.value] = (0.0, 1.0)
            sizes: list[int | None] = [0] * len(Split)
            sizes[split.value] = num_samples[split.value]
            datasets.append(builder.blend_split(split_blend, bookends, sizes)[split.value])
        return datasets[0], datasets[1], datasets[2]
    if blend is None:
        raise ValueError(
            "no data: give --data-path (a blend), per-split data paths, or use the mock dataset"
        )
    blend = as_blend(blend)
    check_prefixes_exist(blend)
    bookends = split_matrix(parse_split(config.split))
    train, valid, test = builder.blend_split(blend, bookends, num_samples)
    return train, valid, test
