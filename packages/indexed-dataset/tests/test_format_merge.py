"""Merging datasets (add_index, merge_datasets) and listing the prefixes of a folder."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mg.indexed_dataset.format import (
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexedDatasetError,
    list_dataset_prefixes,
    merge_datasets,
)


def make(
    prefix: Path, documents: list[list[list[int]]], dtype: type = np.uint16, modes: bool = False
) -> str:
    """Build `prefix` from documents given as lists of sequences; modes = sequence length % 3."""
    with IndexedDatasetBuilder(f"{prefix}.bin", dtype, multimodal=modes) as builder:
        for document in documents:
            for sequence in document:
                builder.add_item(sequence, mode=len(sequence) % 3)
            builder.end_document()
    return str(prefix)


PARTS = [
    [[[1, 2], [3]], [[4]]],
    [[], [[5, 6, 7], []]],
    [[[8]]],
]


def contents(dataset: IndexedDataset) -> list[list[int]]:
    return [sequence.tolist() for sequence in dataset]


@pytest.mark.parametrize("modes", [False, True])
def test_merge_concatenates_documents_in_order(tmp_path: Path, modes: bool) -> None:
    prefixes = [make(tmp_path / f"part_{i}", part, modes=modes) for i, part in enumerate(PARTS)]
    merge_datasets(prefixes, tmp_path / "merged", multimodal=modes)
    merged = IndexedDataset(tmp_path / "merged", multimodal=modes)
    if modes:
        assert merged.sequence_modes is not None
        assert merged.sequence_modes.tolist() == [2, 1, 1, 0, 0, 1]
        merged_tokens = [merged.get(i)[0].tolist() for i in range(len(merged))]
    else:
        merged_tokens = contents(merged)
    assert merged_tokens == [[1, 2], [3], [4], [5, 6, 7], [], [8]]
    # docs: [0,2,3] + shifted [0,0,2]+3 + [0,1]+5
    assert merged.document_indices.tolist() == [0, 2, 3, 3, 5, 6]
    assert merged.sequence_pointers.tolist() == [0, 4, 6, 8, 14, 14]
    expected_bin = b"".join(Path(f"{p}.bin").read_bytes() for p in prefixes)
    assert Path(tmp_path / "merged.bin").read_bytes() == expected_bin


def test_merge_equals_building_in_one_go(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    prefixes = [make(tmp_path / "in" / f"p{i}", part) for i, part in enumerate(PARTS)]
    make(tmp_path / "whole", [document for part in PARTS for document in part])
    merge_datasets(prefixes, tmp_path / "merged")
    for extension in (".bin", ".idx"):
        whole = (tmp_path / f"whole{extension}").read_bytes()
        assert (tmp_path / f"merged{extension}").read_bytes() == whole


def test_add_index_after_own_documents(tmp_path: Path) -> None:
    other = make(tmp_path / "other", [[[9, 9]], [[8]]])
    with IndexedDatasetBuilder(tmp_path / "out.bin", np.uint16) as builder:
        builder.add_document([1, 2, 3], [1, 2])
        builder.add_index(other)
        builder.add_item([7])
        builder.end_document()
    out = IndexedDataset(tmp_path / "out")
    assert contents(out) == [[1], [2, 3], [9, 9], [8], [7]]
    assert out.document_indices.tolist() == [0, 2, 3, 4, 5]


def test_add_index_refuses_open_document(tmp_path: Path) -> None:
    other = make(tmp_path / "other", [[[9]]])
    with IndexedDatasetBuilder(tmp_path / "out.bin", np.uint16) as builder:
        builder.add_item([1])
        with pytest.raises(IndexedDatasetError, match="call end_document"):
            builder.add_index(other)
        builder.abort()


def test_merge_refuses_mixed_dtypes(tmp_path: Path) -> None:
    small = make(tmp_path / "a", [[[1]]], np.uint16)
    wide = make(tmp_path / "b", [[[70000]]], np.int32)
    with pytest.raises(IndexedDatasetError) as caught:
        merge_datasets([small, wide], tmp_path / "merged")
    message = str(caught.value)
    assert f"{wide}.idx: cannot merge" in message and "int32" in message and "uint16" in message
    assert not (tmp_path / "merged.bin").exists() and not (tmp_path / "merged.idx").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin", "a.idx", "b.bin", "b.idx"]


def test_merge_refuses_mixed_kinds(tmp_path: Path) -> None:
    plain = make(tmp_path / "a", [[[1]]])
    multimodal = make(tmp_path / "b", [[[2]]], modes=True)
    with pytest.raises(IndexedDatasetError, match="not multimodal but .*b is multimodal"):
        merge_datasets([plain, multimodal], tmp_path / "merged")


def test_output_folder_must_exist(tmp_path: Path) -> None:
    with pytest.raises(IndexedDatasetError, match="output folder .*nope does not exist"):
        IndexedDatasetBuilder(tmp_path / "nope" / "x.bin")


def test_merge_errors_for_nothing_and_missing(tmp_path: Path) -> None:
    with pytest.raises(IndexedDatasetError, match="nothing to merge"):
        merge_datasets([], tmp_path / "merged")
    with pytest.raises(IndexedDatasetError, match="missing"):
        merge_datasets([str(tmp_path / "ghost")], tmp_path / "merged")
    real = make(tmp_path / "real", [[[1]]])
    with pytest.raises(IndexedDatasetError, match="no indexed dataset here"):
        merge_datasets([real, str(tmp_path / "ghost")], tmp_path / "merged")


def test_merge_into_one_of_its_inputs(tmp_path: Path) -> None:
    first = make(tmp_path / "a", [[[1, 2]]])
    second = make(tmp_path / "b", [[[3]]])
    merge_datasets([first, second], first)
    assert contents(IndexedDataset(first)) == [[1, 2], [3]]


def test_list_prefixes_sorted_like_megatron(tmp_path: Path) -> None:
    folder = tmp_path / "parts"
    folder.mkdir()
    for size, name in enumerate(["part_2", "part_10", "part_1"], start=1):
        make(folder / name, [[[size] * size]])
    (folder / "README.txt").write_text("not a dataset")
    (folder / "part_3.bin.123-abcd.tmp").write_bytes(b"")
    (folder / "sub.idx").mkdir()
    prefixes = list_dataset_prefixes(folder)
    assert prefixes == [str(folder / n) for n in ["part_1", "part_10", "part_2"]]
    merge_datasets(prefixes, tmp_path / "merged")
    assert contents(IndexedDataset(tmp_path / "merged")) == [[3, 3, 3], [2, 2], [1]]


def test_list_prefixes_refuses_half_pairs(tmp_path: Path) -> None:
    make(tmp_path / "a", [[[1]]])
    (tmp_path / "b.bin").write_bytes(b"")
    with pytest.raises(IndexedDatasetError) as caught:
        list_dataset_prefixes(tmp_path)
    assert f"{tmp_path / 'b.idx'}: missing: b.bin is in" in str(caught.value)
