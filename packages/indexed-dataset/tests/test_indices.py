"""Index building against straightforward reference loops, and the on-disk cache.

The references below are line-by-line Python ports of Megatron's C++ loops
(`helpers.cpp`), independent of our vectorised versions; the compat test
compares with the compiled originals.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest

from mg.indexed_dataset import indices
from mg.indexed_dataset.indices import (
    build_blending_indices,
    build_document_index,
    build_exhaustive_blending_indices,
    build_gpt_indices,
    build_sample_index,
    build_shuffle_index,
    cached_indices,
    final_epoch_is_separate,
    num_epochs_needed,
)

# --- reference loops --------------------------------------------------------------------------


def reference_sample_index(
    sizes: np.ndarray,
    document_index: np.ndarray,
    seq_length: int,
    num_epochs: int,
    tokens_per_epoch: int,
    drop_last: bool,
    extra: int,
) -> np.ndarray:
    if drop_last:
        num_samples = (num_epochs * tokens_per_epoch - extra) // seq_length
    else:
        num_samples = int(
            np.ceil(np.float32(num_epochs * tokens_per_epoch - extra) / np.float32(seq_length))
        )
    out = [(0, 0)]
    position, offset = 0, 0
    while len(out) <= num_samples:
        remaining = seq_length + extra
        while remaining != 0:
            length = int(sizes[document_index[position]]) - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - extra
                remaining = 0
            else:
                if position == len(document_index) - 1:
                    offset = int(sizes[document_index[position]]) - extra
                    break
                position += 1
                offset = 0
        out.append((position, offset))
    return np.array(out, dtype=np.int64).reshape(-1, 2)


def reference_blend(weights: list[float], size: int) -> tuple[list[int], list[int]]:
    counts = [0] * len(weights)
    chosen, numbers = [], []
    for i in range(size):
        scale = max(float(i), 1.0)
        best = 0
        best_error = weights[0] * scale - counts[0]
        for d in range(1, len(weights)):
            error = weights[d] * scale - counts[d]
            if error > best_error:
                best, best_error = d, error
        chosen.append(best)
        numbers.append(counts[best])
        counts[best] += 1
    return chosen, numbers


def reference_exhaustive(sizes: list[int]) -> tuple[list[int], list[int]]:
    total = sum(sizes)
    weights = [s / float(total) for s in sizes]
    counts = [0] * len(sizes)
    unspent = [d for d in range(len(sizes))]
    chosen, numbers, i = [], [], 0
    while unspent:
        scale = max(float(i), 1.0)
        best, best_error = -1, -math.inf
        for d in unspent:
            error = weights[d] * scale - counts[d]
            if error > best_error:
                best, best_error = d, error
        chosen.append(best)
        numbers.append(counts[best])
        counts[best] += 1
        if counts[best] == sizes[best]:
            unspent.remove(best)
        i += 1
    return chosen, numbers


# --- epochs -----------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens", [1, 7, 128, 1000, 12345])
@pytest.mark.parametrize("num_samples", [0, 1, 5, 99, 1000])
@pytest.mark.parametrize("extra", [0, 1])
def test_num_epochs_is_megatrons_loop(tokens: int, num_samples: int, extra: int) -> None:
    epochs, seen = 1, tokens
    while seen < num_samples * 16 + extra:
        epochs += 1
        seen += tokens
    assert num_epochs_needed(tokens, num_samples, 16, extra) == epochs


def test_one_epoch_without_sample_count() -> None:
    assert num_epochs_needed(100, None, 16) == 1
    assert not final_epoch_is_separate(100, 1, None, 16)


def test_final_epoch_threshold() -> None:
    # 1281 tokens: 10 samples per epoch of 128 (+1 extra token).
    per_epoch = (1281 - 1) // 128
    assert per_epoch == 10
    assert final_epoch_is_separate(1281, 3, 20 + 7, 128)  # last epoch gives 7 < 8
    assert not final_epoch_is_separate(1281, 3, 20 + 8, 128)  # 8 == 80% of 10


def test_epochs_of_an_empty_split_is_an_error() -> None:
    with pytest.raises(ValueError, match="without tokens"):
        num_epochs_needed(0, 10, 16)


# --- document, sample and shuffle index -------------------------------------------------------


def test_document_index_tiles_and_shuffles() -> None:
    documents = np.arange(10, 20, dtype=np.int32)
    index = build_document_index(documents, 3, np.random.RandomState(1), False)
    assert index.dtype == np.int32
    assert sorted(index.tolist()) == sorted(list(range(10, 20)) * 3)


def test_separate_final_epoch_is_shuffled_on_its_own() -> None:
    documents = np.arange(50, dtype=np.int32)
    index = build_document_index(documents, 4, np.random.RandomState(1), True)
    assert sorted(index[:150].tolist()) == sorted(list(range(50)) * 3)
    assert sorted(index[150:].tolist()) == list(range(50))
    # the same draws as shuffling the two parts as separate arrays, one after the other
    rng = np.random.RandomState(1)
    first, last = np.tile(documents, 3), documents.copy()
    rng.shuffle(first)
    rng.shuffle(last)
    np.testing.assert_array_equal(index, np.concatenate([first, last]))


def random_case(seed: int, num_documents: int, max_length: int, zero_lengths: bool):
    rng = np.random.default_rng(seed)
    low = 0 if zero_lengths else 1
    sizes = rng.integers(low, max_length, size=num_documents).astype(np.int32)
    if zero_lengths:
        sizes[0] = 0  # a leading empty document is the awkward case
    return rng, sizes


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("extra", [0, 1])
@pytest.mark.parametrize("drop_last", [True, False])
def test_sample_index_matches_the_reference_loop(seed: int, extra: int, drop_last: bool) -> None:
    rng, sizes = random_case(seed, 300, 60, zero_lengths=seed % 2 == 0)
    documents = np.arange(20, 280, dtype=np.int32)
    tokens = int(sizes[documents].sum())
    seq_length = int(rng.integers(2, 90))
    epochs = int(rng.integers(1, 4))
    document_index = build_document_index(documents, epochs, np.random.RandomState(seed), False)
    ours = build_sample_index(
        sizes, document_index, seq_length, epochs, tokens, drop_last, bool(extra)
    )
    expected = reference_sample_index(
        sizes, document_index, seq_length, epochs, tokens, drop_last, extra
    )
    assert ours.dtype == np.int32
    np.testing.assert_array_equal(ours, expected)


def test_sample_index_switches_to_int64_like_megatron(monkeypatch: pytest.MonkeyPatch) -> None:
    sizes = np.array([5, 9, 3, 7], dtype=np.int32)
    document_index = np.array([0, 1, 2, 3], dtype=np.int32)
    small = build_sample_index(sizes, document_index, 4, 1, 24)
    monkeypatch.setattr(indices, "_INT32_MAX", 8)  # pretend a sequence is longer than int32
    large = build_sample_index(sizes, document_index, 4, 1, 24)
    assert small.dtype == np.int32 and large.dtype == np.int64
    np.testing.assert_array_equal(small, large)


def test_samples_cover_the_stream_with_one_shared_token() -> None:
    sizes = np.array([5, 9, 3, 7], dtype=np.int32)
    document_index = np.array([2, 0, 3, 1], dtype=np.int32)
    stream = np.concatenate([np.arange(s) + 100 * d for d in document_index for s in [sizes[d]]])
    sample_index = build_sample_index(sizes, document_index, 4, 1, 24)
    starts = np.concatenate(([0], np.cumsum(sizes[document_index])))
    positions = starts[sample_index[:, 0]] + sample_index[:, 1]
    np.testing.assert_array_equal(positions, np.arange(0, 4 * len(sample_index), 4))
    assert len(sample_index) - 1 == (24 - 1) // 4
    assert stream.size == 24


def test_sample_index_rejects_a_wrong_token_count() -> None:
    sizes = np.array([5, 9], dtype=np.int32)
    with pytest.raises(ValueError, match="expected"):
        build_sample_index(sizes, np.array([0, 1], dtype=np.int32), 4, 1, 15)


def test_shuffle_index_keeps_the_final_epoch_apart() -> None:
    index = build_shuffle_index(70, 100, np.random.RandomState(3))
    assert index.dtype == np.uint32
    assert sorted(index[:70].tolist()) == list(range(70))
    assert sorted(index[70:].tolist()) == list(range(70, 100))


def test_gpt_indices_plan() -> None:
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 50, size=200).astype(np.int32)
    documents = np.arange(200, dtype=np.int32)
    tokens = int(sizes.sum())
    per_epoch = (tokens - 1) // 32
    planned = build_gpt_indices(sizes, documents, int(1.5 * per_epoch), 32, 1234)
    assert planned.num_epochs == 2 and planned.separate_final_epoch
    assert len(planned) >= int(1.5 * per_epoch)
    assert sorted(planned.shuffle_index.tolist()) == list(range(len(planned)))


def test_gpt_indices_of_an_empty_split_is_an_error() -> None:
    sizes = np.array([0, 0, 4], dtype=np.int32)
    with pytest.raises(ValueError, match="no tokens"):
        build_gpt_indices(sizes, np.array([0, 1], dtype=np.int32), 10, 8, 1)


# --- blending ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("weights", "size"),
    [
        ([0.5, 0.5], 10),
        ([0.3, 0.7], 1000),
        ([0.2, 0.3, 0.5], 25_000),  # the chunked path
        ([0.01, 0.09, 0.4, 0.5], 30_000),
        ([1 / 3] * 3, 9001),  # ties: the first dataset wins
    ],
)
def test_blend_matches_the_reference_loop(weights: list[float], size: int) -> None:
    chosen, numbers = build_blending_indices(weights, size)
    expected_chosen, expected_numbers = reference_blend(weights, size)
    assert chosen.dtype == np.int16 and numbers.dtype == np.int64
    np.testing.assert_array_equal(chosen, expected_chosen)
    np.testing.assert_array_equal(numbers, expected_numbers)


@pytest.mark.parametrize("seed", range(4))
def test_blend_of_random_skewed_weights(seed: int) -> None:
    rng = np.random.default_rng(seed)
    weights = rng.random(int(rng.integers(2, 12))) ** 3 + 0.002
    weights = (weights / weights.sum()).tolist()
    chosen, numbers = build_blending_indices(weights, 40_000)
    expected_chosen, expected_numbers = reference_blend(weights, 40_000)
    np.testing.assert_array_equal(chosen, expected_chosen)
    np.testing.assert_array_equal(numbers, expected_numbers)


def test_blend_of_one_dataset_and_of_nothing() -> None:
    chosen, numbers = build_blending_indices([1.0], 5)
    assert chosen.tolist() == [0] * 5 and numbers.tolist() == list(range(5))
    chosen, numbers = build_blending_indices([0.5, 0.5], 0)
    assert chosen.size == 0 and numbers.size == 0


@pytest.mark.parametrize("sizes", [[3, 5], [1000, 1, 20], [5000, 7000, 300, 9]])
def test_exhaustive_blend_matches_the_reference_loop(sizes: list[int]) -> None:
    chosen, numbers = build_exhaustive_blending_indices(sizes)
    expected_chosen, expected_numbers = reference_exhaustive(sizes)
    np.testing.assert_array_equal(chosen, expected_chosen)
    np.testing.assert_array_equal(numbers, expected_numbers)
    assert np.bincount(chosen).tolist() == sizes


# --- cache ------------------------------------------------------------------------------------


def counting_builder(calls: list[int]):
    def build() -> dict[str, np.ndarray]:
        calls.append(1)
        return {"a": np.arange(5), "b": np.ones((2, 2), dtype=np.int32)}

    return build


def test_cache_builds_once_then_loads(tmp_path: Path) -> None:
    calls: list[int] = []
    first = cached_indices(
        str(tmp_path), "abc-X-train", "desc", ("a", "b"), counting_builder(calls)
    )
    second = cached_indices(
        str(tmp_path), "abc-X-train", "desc", ("a", "b"), counting_builder(calls)
    )
    assert len(calls) == 1
    np.testing.assert_array_equal(second["a"], first["a"])
    assert second["b"].dtype == np.int32
    assert isinstance(second["a"], np.memmap)  # loaded lazily, not read into memory
    assert sorted(os.listdir(tmp_path)) == [
        "abc-X-train-a.npy",
        "abc-X-train-b.npy",
        "abc-X-train-description.txt",
    ]  # and no temporary files left behind


def test_cache_rebuilds_when_the_description_differs(tmp_path: Path) -> None:
    calls: list[int] = []
    cached_indices(str(tmp_path), "abc", "one", ("a", "b"), counting_builder(calls))
    cached_indices(str(tmp_path), "abc", "two", ("a", "b"), counting_builder(calls))
    assert len(calls) == 2
    assert (tmp_path / "abc-description.txt").read_text() == "two"


def test_cache_rebuilds_when_a_file_is_missing(tmp_path: Path) -> None:
    calls: list[int] = []
    cached_indices(str(tmp_path), "abc", "d", ("a", "b"), counting_builder(calls))
    (tmp_path / "abc-b.npy").unlink()
    cached_indices(str(tmp_path), "abc", "d", ("a", "b"), counting_builder(calls))
    assert len(calls) == 2


def test_no_cache_directory_builds_in_memory(tmp_path: Path) -> None:
    calls: list[int] = []
    cached_indices(None, "abc", "d", ("a", "b"), counting_builder(calls))
    cached_indices(None, "abc", "d", ("a", "b"), counting_builder(calls))
    assert len(calls) == 2
    assert os.listdir(tmp_path) == []
