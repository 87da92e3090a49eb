"""Token dtypes of the `.bin` file and their one-byte codes in the `.idx` header."""

from __future__ import annotations

import numpy as np
from numpy.typing import DTypeLike

from mg.indexed_dataset.errors import IndexedDatasetError

# Megatron's codes, fixed by the file format. Little-endian explicitly: the
# format is little-endian on every machine (on little-endian hosts these equal
# the native dtypes, so `dtype == np.uint16` holds).
DTYPE_BY_CODE: dict[int, np.dtype] = {
    1: np.dtype("<u1"),
    2: np.dtype("<i1"),
    3: np.dtype("<i2"),
    4: np.dtype("<i4"),
    5: np.dtype("<i8"),
    6: np.dtype("<f8"),
    7: np.dtype("<f4"),
    8: np.dtype("<u2"),
}
CODE_BY_DTYPE: dict[np.dtype, int] = {dtype: code for code, dtype in DTYPE_BY_CODE.items()}

# Megatron's threshold (DType.optimal_dtype): a little below 2**16, kept as is
# so that our files pick the same dtype as theirs for the same vocabulary.
UINT16_VOCAB_LIMIT = 65500


def _supported_names() -> str:
    return ", ".join(f"{code} {dtype.name}" for code, dtype in DTYPE_BY_CODE.items())


def normalize_dtype(dtype: DTypeLike) -> np.dtype:
    """Return the little-endian format dtype for `dtype`, or raise if the format lacks it."""
    try:
        resolved = np.dtype(dtype).newbyteorder("<")
    except TypeError as error:
        raise IndexedDatasetError(
            f"{dtype!r} is not a numpy dtype; use one of: {_supported_names()}"
        ) from error
    if resolved not in CODE_BY_DTYPE:
        raise IndexedDatasetError(
            f"dtype {np.dtype(dtype).name} cannot be stored in an indexed dataset; "
            f"use one of: {_supported_names()}"
        )
    return resolved


def dtype_code(dtype: DTypeLike) -> int:
    """The header code of `dtype` (1 uint8 … 8 uint16)."""
    return CODE_BY_DTYPE[normalize_dtype(dtype)]


def dtype_from_code(code: int) -> np.dtype | None:
    """The dtype for header code `code`, or None when the code is unknown."""
    return DTYPE_BY_CODE.get(code)


def best_dtype(vocab_size: int | None) -> np.dtype:
    """The smallest token dtype Megatron would pick for `vocab_size` tokens.

    uint16 halves the `.bin` size whenever every id fits; an unknown vocabulary
    size gets int32, as in Megatron.
    """
    if vocab_size is not None and vocab_size < UINT16_VOCAB_LIMIT:
        return DTYPE_BY_CODE[8]
    return DTYPE_BY_CODE[4]
