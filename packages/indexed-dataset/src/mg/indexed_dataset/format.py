"""Megatron's MMIDIDX `.bin`/`.idx` indexed dataset: one import for the reader, builder and merge.

The format itself is described in `layout.py`; the reader in `reader.py`, the
atomic writer in `builder.py` and the merge tool in `merge.py`.
"""

from mg.indexed_dataset.builder import IndexedDatasetBuilder
from mg.indexed_dataset.dtypes import DTYPE_BY_CODE, best_dtype, dtype_code, dtype_from_code
from mg.indexed_dataset.errors import IndexedDatasetError
from mg.indexed_dataset.layout import IndexHeader, bin_path_of, idx_path_of, read_header
from mg.indexed_dataset.merge import list_dataset_prefixes, merge_datasets
from mg.indexed_dataset.reader import IndexedDataset

# Megatron-Core's names for the path helpers.
get_bin_path = bin_path_of
get_idx_path = idx_path_of

__all__ = [
    "DTYPE_BY_CODE",
    "IndexHeader",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "IndexedDatasetError",
    "best_dtype",
    "bin_path_of",
    "dtype_code",
    "dtype_from_code",
    "get_bin_path",
    "get_idx_path",
    "idx_path_of",
    "list_dataset_prefixes",
    "merge_datasets",
    "read_header",
]
