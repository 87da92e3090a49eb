"""Writes a Megatron MMIDIDX `.bin`/`.idx` pair, atomically.

Tokens stream to a temporary file beside the final `.bin`; `finalize` writes
the `.idx` to another temporary, then renames the `.bin` and last the `.idx`
into place. An interrupted build therefore never leaves a file under a final
name, and an existing `.idx` always belongs to a complete `.bin`. The bytes
written are those Megatron-Core's `IndexedDatasetBuilder` writes for the same
input.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import weakref
from array import array
from types import TracebackType
from typing import IO

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from mg.indexed_dataset.dtypes import normalize_dtype
from mg.indexed_dataset.errors import IndexedDatasetError
from mg.indexed_dataset.layout import (
    LENGTH_DTYPE,
    MODE_DTYPE,
    POINTER_DTYPE,
    IndexHeader,
    idx_path_of,
    read_header,
)
from mg.indexed_dataset.reader import VALIDATION_CHUNK, IndexedDataset

MAX_SEQUENCE_LENGTH = int(np.iinfo(LENGTH_DTYPE).max)
COPY_BUFFER_BYTES = 16 << 20


def temporary_path(final_path: str) -> str:
    """A fresh name beside `final_path`, so that the final rename stays on one filesystem."""
    return f"{final_path}.{os.getpid()}-{secrets.token_hex(4)}.tmp"


def _discard(stream: IO[bytes], paths: list[str]) -> list[str]:
    """Close `stream` and delete `paths`; run on abort, on error and when a builder is lost.

    Returns the paths that could not be deleted. Closing flushes the buffered
    tail, which fails again on a full disk; the files are deleted all the same.
    """
    with contextlib.suppress(OSError):
        stream.close()  # closes the descriptor even when the flush before it fails
    left = []
    for path in paths:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
        except OSError:
            left.append(path)
    return left


def note_left_behind(err: BaseException, paths: list[str]) -> None:
    """Record on `err` the temporary files an abort could not delete (`left_behind`)."""
    if paths:
        err.left_behind = [*getattr(err, "left_behind", []), *paths]  # type: ignore[attr-defined]


class IndexedDatasetBuilder:
    """Builds a dataset sequence by sequence, document by document, or by merging datasets.

    Use it as a context manager: an exception inside the block deletes the
    temporary files, a clean exit finalizes (unless `finalize` or `abort` was
    called in the block)::

        with IndexedDatasetBuilder("corpus_text_document.bin", best_dtype(vocab)) as builder:
            for tokens in documents:
                builder.add_document(tokens, [len(tokens)])
            builder.finalize("corpus_text_document.idx")

    Lengths, document indices and modes are kept in compact arrays (4 + 8 + 1
    bytes per entry), not Python lists, so corpora of 100M+ sequences fit.
    """

    def __init__(
        self,
        bin_path: str | os.PathLike[str],
        dtype: DTypeLike = np.int32,
        multimodal: bool = False,
    ) -> None:
        self.bin_path = os.fspath(bin_path)
        self.dtype: np.dtype = normalize_dtype(dtype)
        self.multimodal = multimodal
        self.finalized = False
        self._lengths = array("i")
        self._document_indices = array("q", [0])
        self._modes = array("b")
        folder = os.path.dirname(os.path.abspath(self.bin_path))
        if not os.path.isdir(folder):
            raise IndexedDatasetError(
                f"{self.bin_path}: the output folder {folder} does not exist; create it first"
            )
        self._bin_temporary = temporary_path(self.bin_path)
        self._bin = open(self._bin_temporary, "xb")  # noqa: SIM115 -- closed by finalize/abort
        self._temporaries = [self._bin_temporary]
        self._cleanup = weakref.finalize(self, _discard, self._bin, self._temporaries)

    # --- adding data --------------------------------------------------------------------------

    def _tokens(self, tokens: ArrayLike) -> np.ndarray:
        """`tokens` as a flat C-order array of the dataset dtype, refusing lossy casts."""
        self._check_open()
        array_in = np.asarray(tokens)
        if array_in.dtype != self.dtype and array_in.size:
            source, target = array_in.dtype, self.dtype
            if source.kind not in "biuf":
                raise TypeError(f"tokens must be numbers, got an array of {source}")
            if target.kind in "iu" and source.kind == "f":
                raise TypeError(
                    f"float tokens ({source}) cannot be stored as {target.name} without loss; "
                    "convert them to integers first"
                )
            if target.kind in "iu" and not np.can_cast(source, target):
                low, high = array_in.min(), array_in.max()
                limits = np.iinfo(target)
                if low < limits.min or high > limits.max:
                    raise IndexedDatasetError(
                        f"{self.bin_path}: token ids {low}..{high} do not fit in {target.name} "
                        f"({limits.min}..{limits.max}); build with a wider dtype (int32 for "
                        "vocabularies of 65500 or more)"
                    )
        return np.ascontiguousarray(array_in, dtype=self.dtype).reshape(-1)

    def _check_open(self) -> None:
        if self._bin.closed or not self._cleanup.alive and not self.finalized:
            state = "finalized" if self.finalized else "aborted"
            raise IndexedDatasetError(f"{self.bin_path}: the builder is already {state}")

    def _write(self, tokens: np.ndarray) -> None:
        self._bin.write(memoryview(tokens).cast("B"))

    def add_item(self, tokens: ArrayLike, mode: int = 0) -> None:
        """Append one sequence (a sentence, or a whole document without sentence splitting)."""
        flat = self._tokens(tokens)
        if flat.size > MAX_SEQUENCE_LENGTH:
            raise IndexedDatasetError(
                f"{self.bin_path}: a sequence of {flat.size} tokens is longer than the format's "
                f"int32 length field allows ({MAX_SEQUENCE_LENGTH}); split it into sentences"
            )
        self._write(flat)
        self._lengths.append(flat.size)
        if self.multimodal:
            self._modes.append(mode)

    def end_document(self) -> None:
        """Close the document made of the sequences added since the previous one."""
        self._check_open()
        self._document_indices.append(len(self._lengths))

    def add_document(
        self, tokens: ArrayLike, lengths: ArrayLike, modes: ArrayLike | None = None
    ) -> None:
        """Append a whole document: `tokens` back to back, cut into sequences of `lengths`."""
        flat = self._tokens(tokens)
        sizes = np.asarray(lengths, dtype=np.int64).reshape(-1)
        if sizes.size and (sizes.min() < 0 or sizes.max() > MAX_SEQUENCE_LENGTH):
            raise IndexedDatasetError(
                f"{self.bin_path}: sequence lengths must be in 0..{MAX_SEQUENCE_LENGTH}, got "
                f"{sizes.min()}..{sizes.max()}"
            )
        if int(sizes.sum()) != flat.size:
            raise IndexedDatasetError(
                f"{self.bin_path}: the document has {flat.size} tokens but its sequence lengths "
                f"add up to {int(sizes.sum())}"
            )
        if self.multimodal:
            kinds = np.zeros(sizes.size, np.int8) if modes is None else np.asarray(modes)
            if kinds.shape != sizes.shape:
                raise IndexedDatasetError(
                    f"{self.bin_path}: {kinds.size} modes given for {sizes.size} sequences"
                )
            self._modes.frombytes(kinds.astype(MODE_DTYPE).tobytes())
        self._write(flat)
        self._lengths.frombytes(sizes.astype(LENGTH_DTYPE).tobytes())
        self._document_indices.append(len(self._lengths))

    def add_index(self, path_prefix: str | os.PathLike[str]) -> None:
        """Append every document of the dataset at `path_prefix` (Megatron's merge step).

        The dtypes must match; the other index is checked in full first, its
        document indices are shifted past ours and its `.bin` is copied as bytes.
        """
        prefix = os.fspath(path_prefix)
        self._check_open()
        self._check_mergeable(prefix)
        if self._document_indices[-1] != len(self._lengths):
            raise IndexedDatasetError(
                f"{self.bin_path}: call end_document() before add_index({prefix!r}): "
                f"{len(self._lengths) - self._document_indices[-1]} sequences are not in a "
                "document yet"
            )
        other = IndexedDataset(prefix, multimodal=self.multimodal)
        shift = len(self._lengths)
        self._lengths.frombytes(other.sequence_lengths.astype(LENGTH_DTYPE).tobytes())
        shifted = other.document_indices[1:] + shift
        self._document_indices.frombytes(shifted.astype(np.int64).tobytes())
        if self.multimodal and other.sequence_modes is not None:
            self._modes.frombytes(other.sequence_modes.tobytes())
        with open(other.bin_path, "rb") as source:
            shutil.copyfileobj(source, self._bin, COPY_BUFFER_BYTES)

    def _check_mergeable(self, prefix: str) -> None:
        idx_path = idx_path_of(prefix)
        if not os.path.isfile(idx_path):
            IndexedDataset(prefix)  # raises the error that names what is missing
        header = read_header(idx_path)
        if header.dtype != self.dtype:
            raise IndexedDatasetError(
                f"{idx_path}: cannot merge: its tokens are {header.dtype.name} but this dataset's "
                f"are {self.dtype.name}; merge only datasets built with the same dtype (same "
                "tokenizer), or rebuild one of them"
            )
        size = os.path.getsize(idx_path)
        if size != header.index_size(self.multimodal) and size == header.index_size(
            not self.multimodal
        ):
            mine, theirs = ("multimodal", "not") if self.multimodal else ("not multimodal", "is")
            raise IndexedDatasetError(
                f"{idx_path}: cannot merge: this dataset is {mine} but {prefix} {theirs} "
                "multimodal; merge only datasets of one kind"
            )

    # --- finishing ----------------------------------------------------------------------------

    def finalize(self, idx_path: str | os.PathLike[str] | None = None) -> None:
        """Write the `.idx` and move both files into place (`.bin` first, `.idx` last).

        `idx_path` defaults to the `.bin` path with `.idx` for `.bin`.
        """
        self._check_open()
        if idx_path is None:
            if not self.bin_path.endswith(".bin"):
                raise IndexedDatasetError(
                    f"{self.bin_path}: does not end in .bin; pass the .idx path to finalize()"
                )
            idx_path = idx_path_of(self.bin_path[: -len(".bin")])
        idx_path = os.fspath(idx_path)
        pending = len(self._lengths) - self._document_indices[-1]
        if pending:
            raise IndexedDatasetError(
                f"{self.bin_path}: {pending} sequences were added after the last "
                "end_document(); call end_document() before finalize() so that they form a "
                "document"
            )
        idx_temporary = temporary_path(idx_path)
        self._temporaries.append(idx_temporary)
        try:
            self._bin.flush()
            os.fsync(self._bin.fileno())
            self._bin.close()
            with open(idx_temporary, "xb") as stream:
                self._write_index(stream)
                stream.flush()
                os.fsync(stream.fileno())
            os.replace(self._bin_temporary, self.bin_path)
            os.replace(idx_temporary, idx_path)
        except BaseException as err:
            note_left_behind(err, self.abort())
            raise
        self._cleanup.detach()
        self.finalized = True

    def _write_index(self, stream: IO[bytes]) -> None:
        lengths = np.frombuffer(self._lengths, dtype=np.intc).astype(LENGTH_DTYPE, copy=False)
        header = IndexHeader(self.dtype, len(lengths), len(self._document_indices))
        stream.write(header.pack())
        stream.write(memoryview(lengths).cast("B"))
        # Pointers are running byte offsets; computed a chunk at a time so that a
        # 100M-sequence index needs no 800 MB temporary.
        start_byte = 0
        itemsize = self.dtype.itemsize
        for start in range(0, len(lengths), VALIDATION_CHUNK):
            sizes = lengths[start : start + VALIDATION_CHUNK].astype(np.int64) * itemsize
            ends = np.cumsum(sizes) + start_byte
            pointers = np.empty_like(ends, dtype=POINTER_DTYPE)
            pointers[0] = start_byte
            pointers[1:] = ends[:-1]
            stream.write(memoryview(pointers).cast("B"))
            start_byte = int(ends[-1])
        documents = np.frombuffer(self._document_indices, dtype=np.int64)
        stream.write(memoryview(documents.astype("<i8", copy=False)).cast("B"))
        if self.multimodal:
            stream.write(memoryview(np.frombuffer(self._modes, dtype=MODE_DTYPE)).cast("B"))

    def abort(self) -> list[str]:
        """Give up the build: close and delete the temporary files. Safe to call twice.

        Returns the temporary files that could not be deleted (none, normally).
        """
        left = self._cleanup()
        return left or []

    def __enter__(self) -> IndexedDatasetBuilder:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if exc_value is not None:
            note_left_behind(exc_value, self.abort())
        elif exc_type is not None:
            self.abort()
        elif not self._bin.closed:  # neither finalized nor aborted inside the block
            self.finalize()

    @property
    def sequence_count(self) -> int:
        return len(self._lengths)

    @property
    def document_count(self) -> int:
        return len(self._document_indices) - 1

    def __repr__(self) -> str:
        state = "finalized" if self.finalized else "building"
        return (
            f"IndexedDatasetBuilder({self.bin_path!r}, dtype={self.dtype.name}, "
            f"sequences={self.sequence_count}, documents={self.document_count}, {state})"
        )
