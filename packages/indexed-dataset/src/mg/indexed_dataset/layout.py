"""Byte layout of Megatron's MMIDIDX `.idx` file: the header and where each section starts.

    offset       size  field
    0            9     magic b"MMIDIDX\\x00\\x00"
    9            8     uint64 version = 1
    17           1     uint8 dtype code of the tokens in .bin
    18           8     uint64 sequence count S
    26           8     uint64 document-index length D (documents + 1)
    34           4*S   int32 sequence lengths
    34+4S        8*S   int64 sequence pointers (byte offsets into .bin)
    34+12S       8*D   int64 document indices
    34+12S+8D    1*S   int8 sequence modes (multimodal datasets only)

Everything is little-endian with no padding, so the arrays after the header
are not aligned; numpy reads them anyway.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import numpy as np

from mg.indexed_dataset.dtypes import DTYPE_BY_CODE, dtype_code, dtype_from_code
from mg.indexed_dataset.errors import IndexedDatasetError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")
HEADER_SIZE = HEADER.size  # 34
# Megatron's older non-mmap formats ("lazy"/"cached"), removed from Megatron-Core.
LEGACY_MAGIC = b"TNTIDX\x00\x00"

LENGTH_DTYPE = np.dtype("<i4")
POINTER_DTYPE = np.dtype("<i8")
DOCUMENT_INDEX_DTYPE = np.dtype("<i8")
MODE_DTYPE = np.dtype("<i1")

REBUILD_HINT = "rebuild it with mg-prep (or Megatron's tools/preprocess_data.py)"


def idx_path_of(path_prefix: str | os.PathLike[str]) -> str:
    """`P.idx` for the dataset prefix `P`."""
    return os.fspath(path_prefix) + ".idx"


def bin_path_of(path_prefix: str | os.PathLike[str]) -> str:
    """`P.bin` for the dataset prefix `P`."""
    return os.fspath(path_prefix) + ".bin"


@dataclass(frozen=True)
class IndexHeader:
    """The fixed 34-byte header of an `.idx` file and the section offsets it implies."""

    dtype: np.dtype
    sequence_count: int
    document_index_length: int

    @property
    def lengths_offset(self) -> int:
        return HEADER_SIZE

    @property
    def pointers_offset(self) -> int:
        return HEADER_SIZE + LENGTH_DTYPE.itemsize * self.sequence_count

    @property
    def document_indices_offset(self) -> int:
        return self.pointers_offset + POINTER_DTYPE.itemsize * self.sequence_count

    @property
    def modes_offset(self) -> int:
        return (
            self.document_indices_offset
            + DOCUMENT_INDEX_DTYPE.itemsize * self.document_index_length
        )

    def index_size(self, multimodal: bool) -> int:
        """Exact `.idx` size in bytes; Python ints, so absurd header counts cannot overflow."""
        return self.modes_offset + (MODE_DTYPE.itemsize * self.sequence_count if multimodal else 0)

    def pack(self) -> bytes:
        """The 34 header bytes."""
        return HEADER.pack(
            MAGIC, VERSION, dtype_code(self.dtype), self.sequence_count, self.document_index_length
        )


def read_header(idx_path: str | os.PathLike[str]) -> IndexHeader:
    """Read and check the header of `idx_path`; sections are not looked at.

    Cheap (one 34-byte read), so tools can inspect a dataset of any size.
    """
    idx_path = os.fspath(idx_path)
    name = os.path.basename(idx_path)
    with open(idx_path, "rb") as stream:
        raw = stream.read(HEADER_SIZE)
    if not raw:
        raise IndexedDatasetError(
            f"{idx_path}: truncated: the file is empty; the file is incomplete — {REBUILD_HINT}"
        )
    if raw[: len(LEGACY_MAGIC)] == LEGACY_MAGIC:
        raise IndexedDatasetError(
            f"{idx_path}: this is Megatron's old 'lazy'/'cached' index format (magic "
            f"{LEGACY_MAGIC!r}), not MMIDIDX; {REBUILD_HINT} to get the mmap format"
        )
    if raw[: len(MAGIC)] != MAGIC[: len(raw)]:
        raise IndexedDatasetError(
            f"{idx_path}: wrong magic {raw[: len(MAGIC)]!r}, expected {MAGIC!r}: {name} is not a "
            f"Megatron MMIDIDX index file; check the path prefix, or {REBUILD_HINT}"
        )
    if len(raw) < HEADER_SIZE:
        raise IndexedDatasetError(
            f"{idx_path}: truncated: the file has {len(raw)} bytes, less than the "
            f"{HEADER_SIZE}-byte header; the file is incomplete — {REBUILD_HINT}"
        )
    _, version, code, sequence_count, document_index_length = HEADER.unpack(raw)
    if version != VERSION:
        raise IndexedDatasetError(
            f"{idx_path}: unsupported version {version}; only version {VERSION} of the MMIDIDX "
            f"format exists — the file is corrupt or from another tool; {REBUILD_HINT}"
        )
    dtype = dtype_from_code(code)
    if dtype is None:
        known = ", ".join(f"{c} {d.name}" for c, d in DTYPE_BY_CODE.items())
        raise IndexedDatasetError(
            f"{idx_path}: unknown dtype code {code} in the header (known: {known}); "
            f"the file is corrupt — {REBUILD_HINT}"
        )
    return IndexHeader(dtype, sequence_count, document_index_length)
