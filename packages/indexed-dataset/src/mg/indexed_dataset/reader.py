"""Lazy reader of a Megatron MMIDIDX `.bin`/`.idx` pair, checked on open.

Opening maps both files and reads nothing else eagerly: the index arrays are
read-only numpy views into a memory map of `.idx`, and a sequence is a view
into a memory map of `.bin` (or, with `mmap=False`, a positional read from the
file). The checks on open are vectorised and done in bounded chunks, so a
corrupt file is reported by name with what to do, instead of surfacing later
as a numpy error or, worse, as silently wrong tokens.
"""

from __future__ import annotations

import mmap as mmap_module
import os
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from mg.indexed_dataset.errors import IndexedDatasetError
from mg.indexed_dataset.layout import (
    DOCUMENT_INDEX_DTYPE,
    LENGTH_DTYPE,
    MODE_DTYPE,
    POINTER_DTYPE,
    REBUILD_HINT,
    IndexHeader,
    bin_path_of,
    idx_path_of,
    read_header,
)

# Elements per validation step: bounds the temporaries to a few tens of MB
# whatever the dataset size, while each step stays one vectorised numpy call.
VALIDATION_CHUNK = 1 << 22

Item = np.ndarray | tuple[np.ndarray, np.int8]
Items = list[np.ndarray] | tuple[list[np.ndarray], np.ndarray]


def _map_read_only(path: str) -> mmap_module.mmap | bytes:
    """Map `path` read-only; an empty file (which mmap refuses) becomes b""."""
    with open(path, "rb") as stream:
        if os.fstat(stream.fileno()).st_size == 0:
            return b""
        return mmap_module.mmap(stream.fileno(), 0, access=mmap_module.ACCESS_READ)


class _FileReader:
    """Reads `.bin` ranges with positional reads instead of a memory map.

    `os.preadv` does not move a shared file offset, so forked data-loader
    workers can share one descriptor; where it is missing (Windows) reads fall
    back to seek + readinto under a lock.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._file = open(path, "rb", buffering=0)  # noqa: SIM115 -- closed in close()
        self._lock = threading.Lock()

    def read(self, dtype: np.dtype, count: int, offset: int) -> np.ndarray:
        out = np.empty(count, dtype=dtype)
        view = memoryview(out).cast("B")
        done = 0
        while done < view.nbytes:
            if hasattr(os, "preadv"):
                got = os.preadv(self._file.fileno(), [view[done:]], offset + done)
            else:
                with self._lock:
                    self._file.seek(offset + done)
                    got = self._file.readinto(view[done:]) or 0
            if got == 0:
                raise IndexedDatasetError(
                    f"{self.path}: truncated while reading: wanted {view.nbytes} bytes at offset "
                    f"{offset} but the file ended after {done}; was it overwritten while in use? "
                    f"Reopen it, or {REBUILD_HINT}"
                )
            done += got
        return out

    def close(self) -> None:
        self._file.close()


class IndexedDataset:
    """The sequences of a `.bin`/`.idx` pair, indexed like Megatron-Core's `IndexedDataset`.

    `dataset[i]` is sequence `i` as a 1-D array of `dtype` (a zero-copy,
    read-only view with `mmap=True`); `dataset[a:b]` is the list of sequences
    `a..b-1`, read in one go. Multimodal datasets return `(tokens, mode)` and
    `(list, modes)` instead, as Megatron does. Document `k` is sequences
    `document_indices[k]` to `document_indices[k + 1]`.

    `validate=False` keeps only the O(1) checks (header, file sizes, the ends
    of the document index, the end of the last sequence against the `.bin`
    size), for re-opening a dataset already checked elsewhere.
    """

    def __init__(
        self,
        path_prefix: str | os.PathLike[str],
        multimodal: bool = False,
        mmap: bool = True,
        *,
        validate: bool = True,
    ) -> None:
        self.path_prefix = os.fspath(path_prefix)
        self.multimodal = multimodal
        self.mmap = mmap
        self.validate = validate
        self._open()

    # --- opening and checking --------------------------------------------------------------

    def _open(self) -> None:
        self.idx_path = idx_path_of(self.path_prefix)
        self.bin_path = bin_path_of(self.path_prefix)
        self._check_files_exist()
        header = read_header(self.idx_path)
        self._check_index_size(header)
        self._header = header
        self.dtype: np.dtype = header.dtype
        self._idx_map = _map_read_only(self.idx_path)
        count = header.sequence_count
        self._lengths = self._index_array(LENGTH_DTYPE, count, header.lengths_offset)
        self._pointers = self._index_array(POINTER_DTYPE, count, header.pointers_offset)
        self._document_indices = self._index_array(
            DOCUMENT_INDEX_DTYPE, header.document_index_length, header.document_indices_offset
        )
        self._modes = (
            self._index_array(MODE_DTYPE, count, header.modes_offset) if self.multimodal else None
        )
        self._check_document_index_ends()
        if self.validate:
            self._check_lengths_and_pointers()
            self._check_document_index_order()
        self._bin_size = os.path.getsize(self.bin_path)
        self._check_bin_size()
        self._file_reader: _FileReader | None = None
        self._bin_map: mmap_module.mmap | bytes = b""
        if self.mmap:
            self._bin_map = _map_read_only(self.bin_path)
        else:
            self._file_reader = _FileReader(self.bin_path)

    def _index_array(self, dtype: np.dtype, count: int, offset: int) -> np.ndarray:
        return np.frombuffer(self._idx_map, dtype=dtype, count=count, offset=offset)

    def _check_files_exist(self) -> None:
        has_idx = os.path.isfile(self.idx_path)
        has_bin = os.path.isfile(self.bin_path)
        if has_idx and has_bin:
            return
        hint = "check the path prefix (the path without .bin/.idx)"
        for extension in (".bin", ".idx"):
            if self.path_prefix.endswith(extension):
                hint = (
                    f"the prefix ends in {extension}: pass it without the extension, "
                    f"e.g. {self.path_prefix[: -len(extension)]!r}"
                )
        if not has_idx and not has_bin:
            raise IndexedDatasetError(
                f"{self.path_prefix}: no indexed dataset here: neither {self.idx_path} nor "
                f"{self.bin_path} exists; {hint}"
            )
        missing, present = (
            (self.bin_path, self.idx_path) if has_idx else (self.idx_path, self.bin_path)
        )
        raise IndexedDatasetError(
            f"{missing}: missing: {os.path.basename(present)} exists but "
            f"{os.path.basename(missing)} does not; the pair is incomplete (an interrupted or "
            f"partly copied build?) — copy the missing file too, or {REBUILD_HINT}"
        )

    def _check_index_size(self, header: IndexHeader) -> None:
        actual = os.path.getsize(self.idx_path)
        expected = header.index_size(self.multimodal)
        if actual == expected:
            return
        counts = (
            f"header says {header.sequence_count} sequences and a document index of "
            f"{header.document_index_length} entries"
        )
        other = header.index_size(not self.multimodal)
        if actual == other and header.sequence_count > 0:
            flag = "multimodal=True" if actual > expected else "multimodal=False"
            kind = "with" if actual > expected else "without"
            raise IndexedDatasetError(
                f"{self.idx_path}: the index has {actual} bytes, which is the size {kind} the "
                f"per-sequence modes of a multimodal dataset ({counts}); open it with {flag}"
            )
        if actual < expected:
            raise IndexedDatasetError(
                f"{self.idx_path}: truncated: {counts}, which needs {expected} bytes of index, "
                f"but the file has {actual} bytes; the file is incomplete — {REBUILD_HINT}"
            )
        raise IndexedDatasetError(
            f"{self.idx_path}: trailing garbage: {counts}, which needs {expected} bytes of "
            f"index, but the file has {actual} bytes ({actual - expected} extra); the file is "
            f"corrupt or was appended to — {REBUILD_HINT}"
        )

    def _fail(self, problem: str) -> IndexedDatasetError:
        return IndexedDatasetError(
            f"{self.idx_path}: {problem}; the index is corrupt — {REBUILD_HINT}"
        )

    def _check_document_index_ends(self) -> None:
        documents = self._document_indices
        count = len(self._lengths)
        if len(documents) == 0:
            raise self._fail(
                "the document index is empty (length 0); a valid one starts with the entry 0"
            )
        if documents[0] != 0:
            raise self._fail(f"the document index starts at {documents[0]}, not at 0")
        if documents[-1] != count:
            raise self._fail(
                f"the document index ends at {documents[-1]}, but the file has {count} sequences "
                "(the last entry must equal the sequence count)"
            )

    def _check_document_index_order(self) -> None:
        documents = self._document_indices
        for start, stop in _chunks(len(documents) - 1):
            steps = np.diff(documents[start : stop + 1])
            if steps.min() < 0:
                at = start + int(np.argmax(steps < 0)) + 1
                raise self._fail(
                    f"the document index is not non-decreasing: entry {at} is {documents[at]}, "
                    f"after {documents[at - 1]}"
                )

    def _check_lengths_and_pointers(self) -> None:
        lengths, pointers = self._lengths, self._pointers
        itemsize = self.dtype.itemsize
        if len(pointers) and pointers[0] != 0:
            raise self._fail(f"sequence pointer 0 is {pointers[0]}, not 0")
        for start, stop in _chunks(len(lengths)):
            chunk = lengths[start:stop]
            if chunk.min() < 0:
                at = start + int(np.argmax(chunk < 0))
                raise self._fail(f"sequence {at} has a negative length ({lengths[at]})")
            # ptr[i + 1] == ptr[i] + len[i] * itemsize, for i in [start, min(stop, S - 1)).
            here = pointers[start:stop]
            after = pointers[start + 1 : stop + 1]
            expected = here[: len(after)] + chunk[: len(after)].astype(np.int64) * itemsize
            wrong = after != expected
            if wrong.any():
                at = start + int(np.argmax(wrong)) + 1
                raise self._fail(
                    f"sequence pointers are inconsistent with the lengths: pointer {at} is "
                    f"{pointers[at]}, but pointer {at - 1} ({pointers[at - 1]}) plus length "
                    f"{lengths[at - 1]} × {itemsize} bytes gives "
                    f"{int(pointers[at - 1]) + int(lengths[at - 1]) * itemsize}"
                )

    def _check_bin_size(self) -> None:
        itemsize = self.dtype.itemsize
        needed = self._data_end()
        if needed > self._bin_size:
            raise IndexedDatasetError(
                f"{self.bin_path}: truncated: the index points to {needed} bytes of "
                f"{self.dtype.name} tokens ({needed // itemsize} tokens), but the file has "
                f"{self._bin_size} bytes (sequence pointers past the end); the .bin is "
                f"incomplete or belongs to another .idx — {REBUILD_HINT}"
            )
        if needed < self._bin_size:
            raise IndexedDatasetError(
                f"{self.bin_path}: size mismatch: the index accounts for {needed} bytes of "
                f"{self.dtype.name} tokens, but the file has {self._bin_size} bytes "
                f"({self._bin_size - needed} not covered by any sequence); the .bin and .idx do "
                f"not belong together — {REBUILD_HINT}"
            )

    def _data_end(self) -> int:
        """Byte offset just past the last sequence (0 for an empty dataset)."""
        if len(self._lengths) == 0:
            return 0
        return int(self._pointers[-1]) + int(self._lengths[-1]) * self.dtype.itemsize

    # --- reading -----------------------------------------------------------------------------

    def _read(self, count: int, offset: int) -> np.ndarray:
        if self._file_reader is not None:
            return self._file_reader.read(self.dtype, count, offset)
        return np.frombuffer(self._bin_map, dtype=self.dtype, count=count, offset=offset)

    def _sequence_index(self, idx: int | np.integer) -> int:
        size = len(self._lengths)
        position = int(idx)
        if position < 0:
            position += size
        if not 0 <= position < size:
            raise IndexError(
                f"sequence {int(idx)} out of range: {self.path_prefix} has {size} sequences"
            )
        return position

    def __len__(self) -> int:
        """The number of sequences (not documents)."""
        return len(self._lengths)

    def __getitem__(self, idx: int | np.integer | slice) -> Item | Items:
        if isinstance(idx, (int, np.integer)):
            return self.get(idx)
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError(
                    f"slices of an IndexedDataset must be contiguous (step 1), got step {step}"
                )
            stop = max(start, stop)
            lengths = self._lengths[start:stop]
            if len(lengths) == 0:
                sequences: list[np.ndarray] = []
            else:
                span = self._read(int(lengths.sum(dtype=np.int64)), int(self._pointers[start]))
                sequences = np.split(span, np.cumsum(lengths[:-1], dtype=np.int64))
            if self._modes is not None:
                return sequences, self._modes[start:stop]
            return sequences
        raise TypeError(
            f"an IndexedDataset is indexed by an int or a slice, not {type(idx).__name__}"
        )

    def get(self, idx: int | np.integer, offset: int = 0, length: int | None = None) -> Item:
        """Tokens `offset` to `offset + length` of sequence `idx` (to its end if length is None).

        Unlike Megatron, a range past the end of the sequence is an error rather
        than a silent read into the next sequence.
        """
        position = self._sequence_index(idx)
        size = int(self._lengths[position])
        offset = int(offset)
        length = size - offset if length is None else int(length)
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(
                f"tokens [{offset}, {offset + length}) out of range: sequence {position} of "
                f"{self.path_prefix} has {size} tokens"
            )
        pointer = int(self._pointers[position]) + offset * self.dtype.itemsize
        tokens = self._read(length, pointer)
        if self._modes is not None:
            return tokens, self._modes[position]
        return tokens

    def __iter__(self) -> Iterator[Item]:
        for position in range(len(self)):
            yield self.get(position)

    # --- index arrays and sizes --------------------------------------------------------------

    @property
    def sequence_lengths(self) -> np.ndarray:
        """Tokens per sequence, int32, read-only."""
        return self._lengths

    @property
    def sequence_pointers(self) -> np.ndarray:
        """Byte offset of each sequence in `.bin`, int64, read-only."""
        return self._pointers

    @property
    def document_indices(self) -> np.ndarray:
        """Document k is sequences [document_indices[k], document_indices[k+1]); int64."""
        return self._document_indices

    @property
    def sequence_modes(self) -> np.ndarray | None:
        """Mode per sequence (int8) for multimodal datasets, else None."""
        return self._modes

    @property
    def num_documents(self) -> int:
        return len(self._document_indices) - 1

    @property
    def num_tokens(self) -> int:
        """Total tokens; O(1), from the end of the last sequence (checked against `.bin`)."""
        return self._data_end() // self.dtype.itemsize

    @staticmethod
    def exists(path_prefix: str | os.PathLike[str]) -> bool:
        """Whether both `P.idx` and `P.bin` exist (says nothing about their content)."""
        return os.path.isfile(idx_path_of(path_prefix)) and os.path.isfile(bin_path_of(path_prefix))

    # --- lifetime -----------------------------------------------------------------------------

    def close(self) -> None:
        """Close the `.bin` file of `mmap=False`; memory maps go when their views do."""
        if self._file_reader is not None:
            self._file_reader.close()
            self._file_reader = None

    def __enter__(self) -> IndexedDataset:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        """Pickle by path: data-loader workers reopen the files instead of copying them."""
        return {
            "path_prefix": self.path_prefix,
            "multimodal": self.multimodal,
            "mmap": self.mmap,
            "validate": self.validate,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path_prefix = state["path_prefix"]
        self.multimodal = state["multimodal"]
        self.mmap = state["mmap"]
        # Checked in full where it was first opened; the cheap checks still
        # catch files replaced since.
        self.validate = False
        self._open()
        self.validate = state["validate"]

    def __repr__(self) -> str:
        return (
            f"IndexedDataset({self.path_prefix!r}, sequences={len(self)}, "
            f"documents={self.num_documents}, dtype={self.dtype.name}"
            f"{', multimodal' if self.multimodal else ''})"
        )


def _chunks(count: int) -> Iterator[tuple[int, int]]:
    """[start, stop) ranges covering [0, count) in VALIDATION_CHUNK steps."""
    for start in range(0, count, VALIDATION_CHUNK):
        yield start, min(start + VALIDATION_CHUNK, count)
