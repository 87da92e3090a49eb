"""Round trips, the byte layout, and the reader/builder API of the MMIDIDX format."""

from __future__ import annotations

import gc
import os
import pickle
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from mg.indexed_dataset import builder as builder_module
from mg.indexed_dataset import reader as reader_module
from mg.indexed_dataset.format import (
    DTYPE_BY_CODE,
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexedDatasetError,
    best_dtype,
    dtype_code,
    read_header,
)

ALL_DTYPES = [DTYPE_BY_CODE[code] for code in sorted(DTYPE_BY_CODE)]

# A document is a list of (tokens, mode) sequences; it may have none.
Document = list[tuple[np.ndarray, int]]


@st.composite
def corpora(draw: st.DrawFn) -> tuple[np.dtype, bool, list[Document], list[bool]]:
    """A dtype, multimodal or not, documents of 0..4 sequences of 0..12 tokens, and per
    document whether to add it whole (add_document) or sequence by sequence (add_item)."""
    dtype = draw(st.sampled_from(ALL_DTYPES))
    multimodal = draw(st.booleans())
    sequence = st.tuples(
        arrays(dtype, st.integers(0, 12)), st.integers(-128, 127) if multimodal else st.just(0)
    )
    documents = draw(st.lists(st.lists(sequence, max_size=4), max_size=6))
    whole = draw(st.lists(st.booleans(), min_size=len(documents), max_size=len(documents)))
    return dtype, multimodal, documents, whole


def build(
    prefix: str, dtype: np.dtype, multimodal: bool, documents: list[Document], whole: list[bool]
) -> None:
    with IndexedDatasetBuilder(prefix + ".bin", dtype, multimodal) as builder:
        for document, at_once in zip(documents, whole, strict=True):
            if at_once:
                tokens = [t for t, _ in document]
                builder.add_document(
                    np.concatenate(tokens) if tokens else np.array([], dtype),
                    [len(t) for t in tokens],
                    [m for _, m in document] if multimodal else None,
                )
            else:
                for tokens, mode in document:
                    builder.add_item(tokens, mode)
                builder.end_document()
        builder.finalize(prefix + ".idx")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(corpora(), st.booleans())
def test_round_trip(corpus: tuple[np.dtype, bool, list[Document], list[bool]], mmap: bool) -> None:
    dtype, multimodal, documents, whole = corpus
    sequences = [s for document in documents for s in document]
    lengths = np.array([len(t) for t, _ in sequences], dtype=np.int64)
    with tempfile.TemporaryDirectory() as folder:
        prefix = os.path.join(folder, "corpus")
        build(prefix, dtype, multimodal, documents, whole)
        dataset = IndexedDataset(prefix, multimodal=multimodal, mmap=mmap)

        assert dataset.dtype == dtype
        assert len(dataset) == len(sequences)
        assert dataset.num_documents == len(documents)
        assert dataset.num_tokens == int(lengths.sum())
        assert dataset.sequence_lengths.dtype == np.int32
        assert dataset.sequence_pointers.dtype == np.int64
        assert dataset.document_indices.dtype == np.int64
        np.testing.assert_array_equal(dataset.sequence_lengths, lengths)
        expected_pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]) * dtype.itemsize
        np.testing.assert_array_equal(dataset.sequence_pointers, expected_pointers[: len(lengths)])
        expected_documents = np.cumsum([0] + [len(document) for document in documents])
        np.testing.assert_array_equal(dataset.document_indices, expected_documents)
        assert os.path.getsize(prefix + ".bin") == int(lengths.sum()) * dtype.itemsize

        for position, (tokens, mode) in enumerate(sequences):
            item = dataset[position]
            if multimodal:
                item, got_mode = item
                assert got_mode == mode
            assert item.dtype == dtype
            # Bytes, so that NaNs and -0.0 of the float dtypes compare exactly.
            assert item.tobytes() == tokens.astype(dtype).tobytes()

        if multimodal:
            assert dataset.sequence_modes is not None
            assert dataset.sequence_modes.dtype == np.int8
            np.testing.assert_array_equal(dataset.sequence_modes, [m for _, m in sequences])
            every, modes = dataset[:]
            np.testing.assert_array_equal(modes, [m for _, m in sequences])
        else:
            assert dataset.sequence_modes is None
            every = dataset[:]
        assert [a.tobytes() for a in every] == [t.tobytes() for t, _ in sequences]
        dataset.close()


@pytest.fixture
def small(tmp_path: Path) -> str:
    """Three documents in uint16: [[1 2 3], []], [[4], [5 6]], [] — empty sequence and document."""
    prefix = str(tmp_path / "small")
    with IndexedDatasetBuilder(prefix + ".bin", np.uint16) as builder:
        builder.add_item([1, 2, 3])
        builder.add_item([])
        builder.end_document()
        builder.add_document([4, 5, 6], [1, 2])
        builder.end_document()
    return prefix


def test_byte_layout_matches_the_reference_table(small: str) -> None:
    """Every byte of .idx and .bin, built by hand from the table in REFERENCE.md §1."""
    lengths, pointers, documents = [3, 0, 1, 2], [0, 6, 6, 8], [0, 2, 4, 4]
    expected = (
        b"MMIDIDX\x00\x00"  # 0: magic
        + struct.pack("<Q", 1)  # 9: version
        + struct.pack("<B", 8)  # 17: dtype code, uint16
        + struct.pack("<Q", 4)  # 18: sequence count S
        + struct.pack("<Q", 4)  # 26: document-index length D
        + struct.pack("<4i", *lengths)  # 34
        + struct.pack("<4q", *pointers)  # 34 + 4S = 50
        + struct.pack("<4q", *documents)  # 34 + 12S = 82
    )
    data = Path(small + ".idx").read_bytes()
    assert len(data) == 34 + 12 * 4 + 8 * 4 == 114
    assert data == expected
    assert data[50:58] == struct.pack("<q", 0) and data[82:90] == struct.pack("<q", 0)
    assert Path(small + ".bin").read_bytes() == struct.pack("<6H", 1, 2, 3, 4, 5, 6)


def test_multimodal_layout_appends_modes(tmp_path: Path) -> None:
    prefix = str(tmp_path / "mm")
    with IndexedDatasetBuilder(prefix + ".bin", np.int32, multimodal=True) as builder:
        builder.add_item([7, 8], mode=1)
        builder.add_item([9], mode=-2)
        builder.end_document()
    data = Path(prefix + ".idx").read_bytes()
    assert data[17] == 4
    assert data[34 + 12 * 2 + 8 * 2 :] == struct.pack("<2b", 1, -2)
    assert Path(prefix + ".bin").read_bytes() == struct.pack("<3i", 7, 8, 9)


def test_reads_a_hand_written_file(tmp_path: Path) -> None:
    """Our reader against bytes not produced by our builder."""
    prefix = tmp_path / "hand"
    header = b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 5, 2, 2)
    idx = header + struct.pack("<2i", 2, 1) + struct.pack("<2q", 0, 16) + struct.pack("<2q", 0, 2)
    Path(f"{prefix}.idx").write_bytes(idx)
    Path(f"{prefix}.bin").write_bytes(struct.pack("<3q", -1, 2**40, 5))
    dataset = IndexedDataset(prefix)
    assert dataset.dtype == np.int64
    assert dataset[0].tolist() == [-1, 2**40] and dataset[1].tolist() == [5]
    assert read_header(f"{prefix}.idx").sequence_count == 2


def test_slices_get_and_indexing(small: str) -> None:
    dataset = IndexedDataset(small)
    assert len(dataset) == 4 and dataset.num_documents == 3 and dataset.num_tokens == 6
    assert dataset[-1].tolist() == [5, 6]
    assert dataset[np.int64(2)].tolist() == [4]
    assert [s.tolist() for s in dataset[1:4]] == [[], [4], [5, 6]]
    assert [s.tolist() for s in dataset[2:]] == [[4], [5, 6]]
    assert dataset[3:3] == [] and dataset[9:] == []
    assert dataset.get(0).tolist() == [1, 2, 3]
    assert dataset.get(0, offset=1).tolist() == [2, 3]
    assert dataset.get(0, offset=1, length=1).tolist() == [2]
    assert dataset.get(0, offset=3).tolist() == []
    assert [s.tolist() for s in dataset] == [[1, 2, 3], [], [4], [5, 6]]
    with pytest.raises(IndexError, match="sequence 4 out of range"):
        dataset[4]
    with pytest.raises(IndexError, match="has 3 tokens"):
        dataset.get(0, offset=2, length=2)  # would run into sequence 1
    with pytest.raises(ValueError, match="contiguous"):
        dataset[::2]
    with pytest.raises(TypeError, match="int or a slice"):
        dataset["0"]  # type: ignore[index]


def test_mmap_views_are_zero_copy_and_read_only(small: str) -> None:
    dataset = IndexedDataset(small)
    first = dataset[0]
    assert not first.flags.writeable and not first.flags.owndata
    assert not dataset.document_indices.flags.writeable
    parts = dataset[0:2]
    assert all(not p.flags.owndata for p in parts)


def test_file_reader_mode(small: str) -> None:
    with IndexedDataset(small, mmap=False) as dataset:
        assert dataset[0].tolist() == [1, 2, 3]
        assert [s.tolist() for s in dataset[0:4]] == [[1, 2, 3], [], [4], [5, 6]]
        assert dataset.get(3, 1).tolist() == [6]
        assert dataset[1].tolist() == []


def test_file_reader_without_preadv(small: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The seek + readinto fallback used where os.preadv is missing (Windows)."""
    monkeypatch.delattr(reader_module.os, "preadv", raising=False)
    with IndexedDataset(small, mmap=False) as dataset:
        assert [s.tolist() for s in dataset] == [[1, 2, 3], [], [4], [5, 6]]
        assert dataset.get(0, 2).tolist() == [3]


def test_pickle_reopens_by_path(small: str) -> None:
    for mmap in (True, False):
        dataset = pickle.loads(pickle.dumps(IndexedDataset(small, mmap=mmap)))
        assert dataset.mmap is mmap and dataset.validate
        assert dataset[3].tolist() == [5, 6]


def test_exists(small: str, tmp_path: Path) -> None:
    assert IndexedDataset.exists(small)
    assert not IndexedDataset.exists(str(tmp_path / "nothing"))
    os.remove(small + ".bin")
    assert not IndexedDataset.exists(small)


def test_empty_dataset(tmp_path: Path) -> None:
    prefix = str(tmp_path / "empty")
    with IndexedDatasetBuilder(prefix + ".bin", np.uint16):
        pass
    dataset = IndexedDataset(prefix)
    assert len(dataset) == 0 and dataset.num_documents == 0 and dataset.num_tokens == 0
    assert dataset[:] == []
    assert Path(prefix + ".idx").stat().st_size == 34 + 8
    assert Path(prefix + ".bin").stat().st_size == 0


def test_best_dtype_and_codes() -> None:
    assert best_dtype(50257) == np.uint16
    assert best_dtype(65499) == np.uint16
    assert best_dtype(65500) == np.int32
    assert best_dtype(128256) == np.int32
    assert best_dtype(None) == np.int32
    codes = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5}
    codes |= {np.float64: 6, np.float32: 7, np.uint16: 8}
    for dtype, code in codes.items():
        assert dtype_code(dtype) == code
    assert dtype_code(">i4") == 4
    with pytest.raises(IndexedDatasetError, match="cannot be stored"):
        dtype_code(np.float16)


def test_builder_refuses_lossy_and_inconsistent_input(tmp_path: Path) -> None:
    builder = IndexedDatasetBuilder(tmp_path / "x.bin", np.uint16)
    with pytest.raises(IndexedDatasetError, match=r"token ids 0\.\.70000 do not fit in uint16"):
        builder.add_item([0, 70000])
    with pytest.raises(TypeError, match="float tokens"):
        builder.add_item(np.array([1.5]))
    with pytest.raises(IndexedDatasetError, match="3 tokens but its sequence lengths add up to 4"):
        builder.add_document([1, 2, 3], [2, 2])
    with pytest.raises(IndexedDatasetError, match="must be in 0"):
        builder.add_document([1, 2, 3], [4, -1])
    builder.add_item(np.array([1, 2], dtype=np.int64))  # fits: accepted
    with pytest.raises(IndexedDatasetError, match="call end_document"):
        builder.finalize(tmp_path / "x.idx")
    builder.end_document()
    builder.finalize(tmp_path / "x.idx")
    assert IndexedDataset(tmp_path / "x")[0].tolist() == [1, 2]
    with pytest.raises(IndexedDatasetError, match="already finalized"):
        builder.add_item([1])


def test_builder_flattens_multidimensional_items(tmp_path: Path) -> None:
    with IndexedDatasetBuilder(tmp_path / "m.bin", np.int32) as builder:
        builder.add_item(np.arange(6).reshape(2, 3))
        builder.end_document()
    assert IndexedDataset(tmp_path / "m")[0].tolist() == [0, 1, 2, 3, 4, 5]


def test_pointers_are_written_in_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The chunked pointer and validation loops agree across chunk boundaries."""
    monkeypatch.setattr(builder_module, "VALIDATION_CHUNK", 3)
    monkeypatch.setattr(reader_module, "VALIDATION_CHUNK", 2)
    sizes = [3, 0, 5, 1, 2, 0, 0, 4, 1, 7]
    with IndexedDatasetBuilder(tmp_path / "c.bin", np.int16) as builder:
        for size in sizes:
            builder.add_item(np.full(size, size))
            builder.end_document()
    dataset = IndexedDataset(tmp_path / "c")
    np.testing.assert_array_equal(
        dataset.sequence_pointers, np.concatenate([[0], np.cumsum(sizes)[:-1]]) * 2
    )
    assert [s.tolist() for s in dataset] == [[size] * size for size in sizes]


# --- atomic writes ------------------------------------------------------------------------------


def test_interrupted_build_leaves_no_file(tmp_path: Path) -> None:
    with (
        pytest.raises(RuntimeError, match="tokenizer crashed"),
        IndexedDatasetBuilder(tmp_path / "corpus.bin", np.uint16) as builder,
    ):
        builder.add_item([1, 2, 3])
        builder.end_document()
        assert [p.name for p in tmp_path.iterdir()][0].endswith(".tmp")
        assert not (tmp_path / "corpus.bin").exists()
        raise RuntimeError("tokenizer crashed")
    assert list(tmp_path.iterdir()) == []


def test_failed_rebuild_keeps_the_previous_dataset(small: str) -> None:
    before = (Path(small + ".bin").read_bytes(), Path(small + ".idx").read_bytes())
    with (
        pytest.raises(KeyboardInterrupt),
        IndexedDatasetBuilder(small + ".bin", np.uint16) as builder,
    ):
        builder.add_item([9, 9, 9, 9])
        raise KeyboardInterrupt
    assert (Path(small + ".bin").read_bytes(), Path(small + ".idx").read_bytes()) == before
    assert sorted(p.name for p in Path(small).parent.iterdir()) == ["small.bin", "small.idx"]


def test_abort_and_forgotten_builders_clean_up(tmp_path: Path) -> None:
    builder = IndexedDatasetBuilder(tmp_path / "a.bin")
    builder.add_item([1])
    builder.abort()
    builder.abort()  # twice is fine
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(IndexedDatasetError, match="aborted"):
        builder.add_item([1])

    forgotten = IndexedDatasetBuilder(tmp_path / "b.bin")
    forgotten.add_item([1])
    assert len(list(tmp_path.iterdir())) == 1
    del forgotten
    gc.collect()
    assert list(tmp_path.iterdir()) == []


def test_finalize_writes_idx_last(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A crash between the two renames leaves a .bin without .idx, never the reverse."""
    renames: list[str] = []
    real_replace = os.replace

    def recording_replace(source: str, target: str) -> None:
        renames.append(os.path.basename(target))
        real_replace(source, target)

    monkeypatch.setattr(builder_module.os, "replace", recording_replace)
    with IndexedDatasetBuilder(tmp_path / "d.bin") as builder:
        builder.add_document([1], [1])
    assert renames == ["d.bin", "d.idx"]
