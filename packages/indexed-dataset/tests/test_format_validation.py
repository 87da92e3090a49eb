"""Every corruption the reader checks for gives an IndexedDatasetError that names the file,
the problem and what to do — never a numpy traceback or a silently wrong read."""

from __future__ import annotations

import struct
import time
from pathlib import Path

import numpy as np
import pytest

from mg.indexed_dataset import reader as reader_module
from mg.indexed_dataset.format import (
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexedDatasetError,
    IndexHeader,
)

REMEDY = "rebuild it with mg-prep"


def write_raw(
    prefix: Path,
    lengths: list[int],
    pointers: list[int] | None = None,
    documents: list[int] | None = None,
    *,
    code: int = 8,
    magic: bytes = b"MMIDIDX\x00\x00",
    version: int = 1,
    modes: list[int] | None = None,
    bin_bytes: int | None = None,
    sequence_count: int | None = None,
    document_count: int | None = None,
) -> str:
    """Write a `.idx`/`.bin` pair byte by byte, consistent unless told otherwise (uint16)."""
    itemsize = 2
    if pointers is None:
        pointers = [sum(lengths[:i]) * itemsize for i in range(len(lengths))]
    if documents is None:
        documents = list(range(len(lengths) + 1))
    count = len(lengths) if sequence_count is None else sequence_count
    doc_count = len(documents) if document_count is None else document_count
    data = magic + struct.pack("<QBQQ", version, code, count, doc_count)
    data += struct.pack(f"<{len(lengths)}i", *lengths)
    data += struct.pack(f"<{len(pointers)}q", *pointers)
    data += struct.pack(f"<{len(documents)}q", *documents)
    if modes is not None:
        data += struct.pack(f"<{len(modes)}b", *modes)
    Path(f"{prefix}.idx").write_bytes(data)
    size = sum(max(n, 0) for n in lengths) * itemsize if bin_bytes is None else bin_bytes
    Path(f"{prefix}.bin").write_bytes(b"\x01" * size)
    return str(prefix)


def expect_error(prefix: str | Path, *fragments: str, **kwargs: bool) -> str:
    """Open `prefix`, expect IndexedDatasetError, check the message holds every fragment."""
    with pytest.raises(IndexedDatasetError) as caught:
        IndexedDataset(prefix, **kwargs)
    message = str(caught.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


def test_the_error_is_a_value_error() -> None:
    assert issubclass(IndexedDatasetError, ValueError)


def test_a_consistent_raw_file_opens(tmp_path: Path) -> None:
    prefix = write_raw(tmp_path / "ok", [2, 0, 3], documents=[0, 2, 3])
    dataset = IndexedDataset(prefix)
    assert dataset.sequence_lengths.tolist() == [2, 0, 3]
    assert dataset.num_documents == 2


# --- missing files ------------------------------------------------------------------------------


def test_missing_idx(tmp_path: Path) -> None:
    prefix = write_raw(tmp_path / "c", [1])
    Path(prefix + ".idx").unlink()
    message = expect_error(prefix, f"{prefix}.idx: missing", "c.bin exists but c.idx does not")
    assert "copy the missing file" in message


def test_missing_bin(tmp_path: Path) -> None:
    prefix = write_raw(tmp_path / "c", [1])
    Path(prefix + ".bin").unlink()
    expect_error(prefix, f"{prefix}.bin: missing", "c.idx exists but c.bin does not")


def test_missing_both_and_prefix_with_extension(tmp_path: Path) -> None:
    expect_error(tmp_path / "nothing", "no indexed dataset here", "nothing.idx", "nothing.bin")
    prefix = write_raw(tmp_path / "c", [1])
    expect_error(prefix + ".bin", "pass it without the extension", repr(prefix))


# --- header -------------------------------------------------------------------------------------


def test_wrong_magic(tmp_path: Path) -> None:
    prefix = write_raw(tmp_path / "c", [1], magic=b"NOTANIDX\x00")
    expect_error(prefix, f"{prefix}.idx: wrong magic", "not a Megatron MMIDIDX index", REMEDY)


def test_legacy_magic(tmp_path: Path) -> None:
    prefix = write_raw(tmp_path / "c", [1], magic=b"TNTIDX\x00\x00\x00")
    expect_error(prefix, f"{prefix}.idx", "old 'lazy'/'cached' index format", REMEDY)


def test_unsupported_version(tmp_path: Path) -> None:
    prefix = write_raw(tmp_path / "c", [1], version=2)
    expect_error(prefix, f"{prefix}.idx: unsupported version 2", REMEDY)


@pytest.mark.parametrize("code", [0, 9, 255])
def test_unknown_dtype_code(tmp_path: Path, code: int) -> None:
    prefix = write_raw(tmp_path / "c", [1], code=code)
    expect_error(prefix, f"{prefix}.idx: unknown dtype code {code}", "8 uint16", REMEDY)


def test_truncated_header_and_empty_index(tmp_path: Path) -> None:
    prefix = write_raw(tmp_path / "c", [1])
    data = Path(prefix + ".idx").read_bytes()
    Path(prefix + ".idx").write_bytes(data[:20])
    expect_error(prefix, f"{prefix}.idx: truncated", "20 bytes", "34-byte header", REMEDY)
    Path(prefix + ".idx").write_bytes(data[:5])
    expect_error(prefix, f"{prefix}.idx: truncated")
    Path(prefix + ".idx").write_bytes(b"")
    expect_error(prefix, f"{prefix}.idx: truncated: the file is empty", REMEDY)


# --- index size ---------------------------------------------------------------------------------


def test_truncated_index(tmp_path: Path) -> None:
    prefix = write_raw(tmp_path / "c", [1] * 1000)
    data = Path(prefix + ".idx").read_bytes()
    assert len(data) == 34 + 12 * 1000 + 8 * 1001
    Path(prefix + ".idx").write_bytes(data[:5000])
    expect_error(
        prefix,
        f"{prefix}.idx: truncated: header says 1000 sequences",
        "which needs 20042 bytes of index, but the file has 5000 bytes",
        "the file is incomplete",
        REMEDY,
    )


def test_absurd_header_counts_are_truncation_not_overflow(tmp_path: Path) -> None:
    prefix = write_raw(tmp_path / "c", [1], sequence_count=2**63 + 5)
    expect_error(prefix, "truncated", f"header says {2**63 + 5} sequences")


def test_trailing_garbage(tmp_path: Path) -> None:
    prefix = write_raw(tmp_path / "c", [1, 2])
    with open(prefix + ".idx", "ab") as stream:
        stream.write(b"junk")
    expect_error(prefix, f"{prefix}.idx: trailing garbage", "(4 extra)", REMEDY)


def test_multimodal_flag_mismatch_is_explained(tmp_path: Path) -> None:
    multimodal = write_raw(tmp_path / "mm", [1, 2], modes=[0, 1])
    expect_error(multimodal, f"{multimodal}.idx", "open it with multimodal=True")
    plain = write_raw(tmp_path / "plain", [1, 2])
    expect_error(plain, f"{plain}.idx", "open it with multimodal=False", multimodal=True)


# --- document index -----------------------------------------------------------------------------


def test_document_index_empty(tmp_path: Path) -> None:
    prefix = write_raw(tmp_path / "c", [1], documents=[])
    expect_error(prefix, f"{prefix}.idx: the document index is empty", REMEDY)


def test_document_index_not_starting_at_zero(tmp_path: Path) -> None:
    prefix = write_raw(tmp_path / "c", [1, 1], documents=[1, 2])
    expect_error(prefix, f"{prefix}.idx: the document index starts at 1, not at 0", REMEDY)


def test_document_index_decreasing(tmp_path: Path) -> None:
    prefix = write_raw(tmp_path / "c", [1, 1, 1], documents=[0, 2, 1, 3])
    expect_error(
        prefix, f"{prefix}.idx: the document index is not non-decreasing", "entry 2 is 1, after 2"
    )


def test_document_index_last_entry(tmp_path: Path) -> None:
    prefix = write_raw(tmp_path / "c", [1, 1, 1], documents=[0, 2])
    expect_error(prefix, "the document index ends at 2, but the file has 3 sequences", REMEDY)


# --- lengths and pointers -----------------------------------------------------------------------


def test_first_pointer_not_zero(tmp_path: Path) -> None:
    prefix = write_raw(tmp_path / "c", [1, 1], pointers=[2, 4], bin_bytes=6)
    expect_error(prefix, f"{prefix}.idx: sequence pointer 0 is 2, not 0", REMEDY)


def test_pointers_inconsistent_with_lengths(tmp_path: Path) -> None:
    prefix = write_raw(tmp_path / "c", [3, 1, 2], pointers=[0, 6, 10])
    expect_error(
        prefix,
        f"{prefix}.idx: sequence pointers are inconsistent with the lengths",
        "pointer 2 is 10, but pointer 1 (6) plus length 1 × 2 bytes gives 8",
        REMEDY,
    )


def test_negative_length(tmp_path: Path) -> None:
    prefix = write_raw(tmp_path / "c", [2, -1, 1], pointers=[0, 4, 2], bin_bytes=4)
    expect_error(prefix, f"{prefix}.idx: sequence 1 has a negative length (-1)", REMEDY)


def test_errors_are_found_across_validation_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reader_module, "VALIDATION_CHUNK", 4)
    lengths = [1] * 11
    good = [2 * i for i in range(11)]
    for broken in (3, 4, 5, 8, 10):
        pointers = list(good)
        pointers[broken] += 2
        prefix = write_raw(tmp_path / f"p{broken}", lengths, pointers=pointers)
        expect_error(prefix, f"pointer {broken} is {good[broken] + 2}")
    prefix = write_raw(tmp_path / "d", [1] * 9, documents=[0, 1, 2, 3, 5, 4, 6, 9])
    expect_error(prefix, "entry 5 is 4, after 5")
    IndexedDataset(write_raw(tmp_path / "ok", lengths))  # and a good file still passes


# --- .bin size ----------------------------------------------------------------------------------


def test_pointers_past_the_end_of_bin(tmp_path: Path) -> None:
    prefix = write_raw(tmp_path / "c", [4, 4], bin_bytes=10)
    expect_error(
        prefix,
        f"{prefix}.bin: truncated: the index points to 16 bytes of uint16 tokens (8 tokens)",
        "the file has 10 bytes",
        "sequence pointers past the end",
        REMEDY,
    )


def test_bin_larger_than_the_index_accounts_for(tmp_path: Path) -> None:
    prefix = write_raw(tmp_path / "c", [4, 4], bin_bytes=20)
    expect_error(
        prefix,
        f"{prefix}.bin: size mismatch: the index accounts for 16 bytes",
        "the file has 20 bytes (4 not covered by any sequence)",
        "do not belong together",
    )


def test_bin_checks_run_without_full_validation(tmp_path: Path) -> None:
    prefix = write_raw(tmp_path / "c", [4, 4], bin_bytes=10)
    expect_error(prefix, "truncated", validate=False)
    prefix = write_raw(tmp_path / "d", [1, 1], documents=[0, 1])
    expect_error(prefix, "the document index ends at 1", validate=False)


def test_bin_truncated_after_opening_is_reported_in_file_mode(tmp_path: Path) -> None:
    with IndexedDatasetBuilder(tmp_path / "c.bin", np.int32) as builder:
        builder.add_document(np.arange(10), [4, 6])
    dataset = IndexedDataset(tmp_path / "c", mmap=False)
    with open(tmp_path / "c.bin", "r+b") as stream:
        stream.truncate(20)
    with pytest.raises(IndexedDatasetError, match="truncated while reading"):
        dataset[1]


def test_corrupt_merge_input_is_rejected(tmp_path: Path) -> None:
    prefix = write_raw(tmp_path / "bad", [3, 1], pointers=[0, 2])
    with IndexedDatasetBuilder(tmp_path / "out.bin", np.uint16) as builder:
        with pytest.raises(IndexedDatasetError, match="inconsistent with the lengths"):
            builder.add_index(prefix)
        builder.abort()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.bin", "bad.idx"]


@pytest.mark.slow
def test_opening_ten_million_sequences_is_fast(tmp_path: Path) -> None:
    """Full validation of 10M sequences stays well under a second (≈50 ms measured warm on a
    2-core machine, ≈0.2 s on the first open; 100M sequences ≈0.5 s)."""
    count = 10_000_000
    lengths = np.random.default_rng(0).integers(0, 200, count).astype("<i4")
    pointers = np.zeros(count, "<i8")
    np.cumsum(lengths[:-1].astype(np.int64) * 2, out=pointers[1:])
    documents = np.arange(0, count + 1, 2, dtype="<i8")
    prefix = tmp_path / "big"
    with open(f"{prefix}.idx", "wb") as stream:
        stream.write(IndexHeader(np.dtype("<u2"), count, len(documents)).pack())
        for array in (lengths, pointers, documents):
            stream.write(array.tobytes())
    with open(f"{prefix}.bin", "wb") as stream:
        stream.truncate(int(pointers[-1]) + int(lengths[-1]) * 2)  # sparse: no disk used
    IndexedDataset(prefix)  # warm the page cache, as a second open in training would be
    start = time.perf_counter()
    dataset = IndexedDataset(prefix)
    elapsed = time.perf_counter() - start
    assert len(dataset) == count and dataset.num_tokens == int(lengths.sum())
    assert elapsed < 1.0, f"opening took {elapsed:.2f} s"
