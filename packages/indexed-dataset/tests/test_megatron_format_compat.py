"""Byte compatibility with Megatron-Core's indexed dataset (megatron-core 0.16.1, test-only).

For the same input our builder and Megatron's write identical `.bin`/`.idx`
files, each reader opens the other's files, and merges agree byte for byte.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mg.indexed_dataset.format import IndexedDataset, IndexedDatasetBuilder

pytestmark = pytest.mark.compat

with warnings.catch_warnings():
    # Importing megatron.core warns that Transformer Engine and Apex are missing.
    warnings.simplefilter("ignore")
    megatron = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    torch = pytest.importorskip("torch")

Corpus = list[list[list[int]]]  # documents -> sentences -> token ids


def make_corpus(seed: int, vocab_size: int) -> Corpus:
    """Documents of 0..5 sentences of 0..30 tokens; an empty document and an empty sentence
    are always present, as preprocess_data.py can produce them."""
    rng = np.random.default_rng(seed)
    corpus: Corpus = [
        [rng.integers(0, vocab_size, rng.integers(0, 31)).tolist() for _ in range(rng.integers(6))]
        for _ in range(40)
    ]
    corpus[3] = []
    corpus[5] = [[1, 2], [], [vocab_size - 1]]
    return corpus


CASES = {
    "document-uint16": (np.uint16, "document", False),
    "sentence-uint16": (np.uint16, "sentence", False),
    "document-int32": (np.int32, "document", False),
    "sentence-int32": (np.int32, "sentence", False),
    "sentence-int32-multimodal": (np.int32, "sentence", True),
}


def sequences_of(document: list[list[int]], level: str) -> list[list[int]]:
    """What preprocess_data.py stores per document: its sentences, or one flat sequence."""
    if level == "sentence":
        return document
    return [[token for sentence in document for token in sentence]] if document else []


def modes_of(sequences: list[list[int]]) -> list[int]:
    return [len(sequence) % 4 for sequence in sequences]


def build_with(builder: Any, corpus: Corpus, level: str, multimodal: bool) -> None:
    """Feed `corpus` through add_document (even documents) and add_item (odd ones), as the
    two builders' common API; torch tensors for add_item because Megatron's needs them."""
    for number, document in enumerate(corpus):
        sequences = sequences_of(document, level)
        modes = modes_of(sequences)
        if number % 2 == 0:
            flat = [token for sequence in sequences for token in sequence]
            lengths = [len(sequence) for sequence in sequences]
            builder.add_document(flat, lengths, modes if multimodal else None)
        else:
            for sequence, mode in zip(sequences, modes, strict=True):
                builder.add_item(torch.tensor(sequence, dtype=torch.int64), mode)
            builder.end_document()


def build_both(tmp_path: Path, corpus: Corpus, case: str) -> tuple[str, str]:
    dtype, level, multimodal = CASES[case]
    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
    with IndexedDatasetBuilder(ours + ".bin", dtype, multimodal) as builder:
        build_with(builder, corpus, level, multimodal)
        builder.finalize(ours + ".idx")
    reference = megatron.IndexedDatasetBuilder(theirs + ".bin", dtype=dtype, multimodal=multimodal)
    build_with(reference, corpus, level, multimodal)
    reference.finalize(theirs + ".idx")
    return ours, theirs


def expected(corpus: Corpus, level: str) -> tuple[list[list[int]], list[int]]:
    sequences: list[list[int]] = []
    documents = [0]
    for document in corpus:
        sequences += sequences_of(document, level)
        documents.append(len(sequences))
    return sequences, documents


@pytest.mark.parametrize("case", list(CASES))
def test_same_bytes_as_megatron(tmp_path: Path, case: str) -> None:
    vocab = 50257 if CASES[case][0] is np.uint16 else 128256
    ours, theirs = build_both(tmp_path, make_corpus(seed=len(case), vocab_size=vocab), case)
    for extension in (".bin", ".idx"):
        mine = Path(ours + extension).read_bytes()
        reference = Path(theirs + extension).read_bytes()
        assert len(mine) == len(reference)
        assert mine == reference, f"{extension} differs"


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mmap", [True, False])
def test_each_reader_opens_the_others_files(tmp_path: Path, case: str, mmap: bool) -> None:
    dtype, level, multimodal = CASES[case]
    corpus = make_corpus(seed=7, vocab_size=60000)
    ours, theirs = build_both(tmp_path, corpus, case)
    sequences, documents = expected(corpus, level)
    modes = modes_of(sequences)

    mine = IndexedDataset(theirs, multimodal=multimodal, mmap=mmap)
    reference = megatron.IndexedDataset(ours, multimodal=multimodal, mmap=mmap)
    for dataset in (mine, reference):
        assert len(dataset) == len(sequences)
        np.testing.assert_array_equal(dataset.sequence_lengths, [len(s) for s in sequences])
        np.testing.assert_array_equal(dataset.document_indices, documents)
        for position, sequence in enumerate(sequences):
            item = dataset[position]
            if multimodal:
                item, mode = item
                assert mode == modes[position]
            assert item.dtype == dtype
            assert item.tolist() == sequence
        part = dataset[2:9]
        if multimodal:
            part, part_modes = part
            assert part_modes.tolist() == modes[2:9]
        assert [p.tolist() for p in part] == sequences[2:9]
        longest = int(np.argmax(dataset.sequence_lengths))
        got = dataset.get(longest, offset=2, length=5)
        got = got[0] if multimodal else got
        assert got.tolist() == sequences[longest][2:7]
    np.testing.assert_array_equal(mine.sequence_pointers, reference.index.sequence_pointers)
    if multimodal:
        # Megatron's own `sequence_modes` property cannot be used on arrays (it
        # asserts on the array's truth value), so compare with its index.
        np.testing.assert_array_equal(mine.sequence_modes, reference.index.sequence_modes)
        np.testing.assert_array_equal(mine.sequence_modes, modes)
    assert mine.dtype == reference.index.dtype


@pytest.mark.parametrize("case", ["sentence-uint16", "document-int32", "sentence-int32-multimodal"])
def test_merge_matches_megatron(tmp_path: Path, case: str) -> None:
    dtype, level, multimodal = CASES[case]
    parts = []
    for number in range(3):
        folder = tmp_path / f"part{number}"
        folder.mkdir()
        parts.append(build_both(folder, make_corpus(seed=number, vocab_size=30000), case))
    merged = str(tmp_path / "merged_ours")
    with IndexedDatasetBuilder(merged + ".bin", dtype, multimodal) as builder:
        for ours, _ in parts:
            builder.add_index(ours)
    reference_merged = str(tmp_path / "merged_theirs")
    reference = megatron.IndexedDatasetBuilder(
        reference_merged + ".bin", dtype=dtype, multimodal=multimodal
    )
    for _, theirs in parts:
        reference.add_index(theirs)
    reference.finalize(reference_merged + ".idx")
    for extension in (".bin", ".idx"):
        assert (
            Path(merged + extension).read_bytes() == Path(reference_merged + extension).read_bytes()
        )
