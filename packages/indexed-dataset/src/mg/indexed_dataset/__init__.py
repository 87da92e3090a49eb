"""Megatron's MMIDIDX .bin/.idx format and the GPT sample datasets built on it.

from mg.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from mg.indexed_dataset import GPTDatasetConfig, build_gpt_datasets, parse_data_path
"""

from mg.indexed_dataset.blended import BlendedDataset
from mg.indexed_dataset.format import (
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexedDatasetError,
    best_dtype,
    get_bin_path,
    get_idx_path,
    list_dataset_prefixes,
    merge_datasets,
)
from mg.indexed_dataset.gpt_dataset import GPTDataset, GPTDatasetConfig, build_gpt_datasets
from mg.indexed_dataset.mock import MockGPTDataset, build_mock_gpt_datasets
from mg.indexed_dataset.split import (
    Blend,
    Split,
    parse_data_path,
    parse_split,
    read_blend_file,
    samples_per_split,
)

__version__ = "0.1.0"

__all__ = [
    "Blend",
    "BlendedDataset",
    "GPTDataset",
    "GPTDatasetConfig",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "IndexedDatasetError",
    "MockGPTDataset",
    "Split",
    "best_dtype",
    "build_gpt_datasets",
    "build_mock_gpt_datasets",
    "get_bin_path",
    "get_idx_path",
    "list_dataset_prefixes",
    "merge_datasets",
    "parse_data_path",
    "parse_split",
    "read_blend_file",
    "samples_per_split",
]
