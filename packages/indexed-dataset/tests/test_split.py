"""Split strings, the three `--data-path` forms, blend files and sample counts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mg.indexed_dataset.split import (
    Blend,
    check_prefixes_exist,
    parse_data_path,
    parse_split,
    read_blend_file,
    read_per_split_blend_file,
    samples_per_split,
    split_matrix,
    split_range,
)

# --- split strings ----------------------------------------------------------------------------


def test_default_split_is_normalised_in_float64() -> None:
    weights = np.array([969.0, 30.0, 1.0])
    assert parse_split("969,30,1") == (weights / weights.sum()).tolist()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("99,1", [0.99, 0.01, 0.0]),
        ("1", [1.0, 0.0, 0.0]),
        ("969, 30, 1", parse_split("969,30,1")),
        ("90/5/5", [0.9, 0.05, 0.05]),
        ("0.8,0.2,0", [0.8, 0.2, 0.0]),
    ],
)
def test_split_forms(text: str, expected: list[float]) -> None:
    assert parse_split(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["", "a,b,c", "1,2,3,4", "0,0,0", "-1,2,1", "nan,1,1", "1,,1"])
def test_bad_split_is_a_clear_error(text: str) -> None:
    with pytest.raises(ValueError, match="split"):
        parse_split(text)


def test_bad_split_names_the_field_and_an_example() -> None:
    with pytest.raises(ValueError, match=r"'x' is not a non-negative number.*969,30,1"):
        parse_split("90,x,1")


def test_split_matrix_bookends_and_empty_splits() -> None:
    assert split_matrix([0.5, 0.5, 0.0]) == [(0.0, 0.5), (0.5, 1.0), None]
    assert split_matrix([0.0, 1.0, 0.0]) == [None, (0.0, 1.0), None]


def test_split_range_rounds_half_to_even_like_megatron() -> None:
    # round(2.5) == 2 in Python, which is what Megatron's int(round(...)) gives.
    np.testing.assert_array_equal(split_range((0.0, 0.5), 5), [0, 1])
    np.testing.assert_array_equal(split_range((0.5, 1.0), 5), [2, 3, 4])
    assert split_range((0.0, 0.5), 5).dtype == np.int32


def test_default_split_of_a_thousand_documents() -> None:
    ranges = [split_range(ends, 1000) for ends in split_matrix(parse_split("969,30,1"))]
    assert [(int(r[0]), int(r[-1]) + 1) for r in ranges] == [(0, 969), (969, 999), (999, 1000)]


# --- --data-path ------------------------------------------------------------------------------


def test_data_path_single_prefix() -> None:
    assert parse_data_path(["data/a"]) == Blend(("data/a",))
    assert parse_data_path("data/a") == Blend(("data/a",))


def test_data_path_weighted_pairs() -> None:
    blend = parse_data_path("0.3 data/a 0.7 data/b")
    assert blend == Blend(("data/a", "data/b"), (0.3, 0.7))
    assert parse_data_path(["30", "data/a", "70", "data/b"]).normalized_weights() == [0.3, 0.7]


def test_data_path_prefixes_only() -> None:
    blend = parse_data_path(["data/a", "data/b"])
    assert blend == Blend(("data/a", "data/b"))
    assert blend.normalized_weights() is None


@pytest.mark.parametrize(
    ("words", "message"),
    [
        ("x 0.3 y 0.7", r"weight number 1 is 'x', not a number"),
        ("0.3 a 0.7", r"weight/prefix pairs"),
        ("0.3 a -1 b", r"the weight of 'b' is -1; weights must be > 0"),
        ("0.3 a 0 b", r"weights must be > 0"),
        ("0.5", r"is a number, not a dataset prefix"),
        ("1 2", r"'2' \(after weight 1\) is a number"),
        ("", r"empty"),
    ],
)
def test_data_path_errors_name_the_problem(words: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_data_path(words)


def test_blend_needs_one_weight_per_prefix() -> None:
    with pytest.raises(ValueError, match="one weight per prefix"):
        Blend(("a", "b"), (1.0,))


def test_blend_file_with_comments_and_lines(tmp_path: Path) -> None:
    path = tmp_path / "blend.txt"
    path.write_text("# web and books\n0.6 data/web\n  0.4   data/books\n")
    assert read_blend_file(path) == Blend(("data/web", "data/books"), (0.6, 0.4))


def test_blend_file_errors_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "blend.txt"
    path.write_text("0.6 data/web 0.4\n")
    with pytest.raises(ValueError, match="blend file .*blend.txt"):
        read_blend_file(path)


def test_per_split_blend_file(tmp_path: Path) -> None:
    path = tmp_path / "splits.json"
    path.write_text(json.dumps({"train": "0.7 A 0.3 B", "valid": ["C"], "test": None}))
    assert read_per_split_blend_file(path) == [
        Blend(("A", "B"), (0.7, 0.3)),
        Blend(("C",)),
        None,
    ]


def test_per_split_blend_file_errors(tmp_path: Path) -> None:
    path = tmp_path / "splits.json"
    path.write_text(json.dumps({"training": "A"}))
    with pytest.raises(ValueError, match="unknown keys"):
        read_per_split_blend_file(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_per_split_blend_file(path)


def test_missing_prefix_names_the_path(tmp_path: Path) -> None:
    (tmp_path / "present.idx").write_bytes(b"")
    (tmp_path / "present.bin").write_bytes(b"")
    (tmp_path / "half.bin").write_bytes(b"")
    check_prefixes_exist(Blend((str(tmp_path / "present"),)))
    with pytest.raises(FileNotFoundError, match=r"half.*half\.idx not found"):
        check_prefixes_exist(Blend((str(tmp_path / "present"), str(tmp_path / "half"))))
    with pytest.raises(FileNotFoundError, match=r"gone\.idx and .*gone\.bin not found"):
        check_prefixes_exist(Blend((str(tmp_path / "gone"),)))


# --- sample counts ----------------------------------------------------------------------------


def test_samples_per_split_from_iterations() -> None:
    # train = iters * GBS; valid = (iters // interval + 1) * eval_iters * GBS;
    # test = eval_iters * GBS
    assert samples_per_split(
        train_iters=1000, global_batch_size=8, eval_interval=100, eval_iters=10
    ) == (8000, 880, 80)
    assert samples_per_split(
        train_iters=250, global_batch_size=32, eval_interval=100, eval_iters=5
    ) == (8000, 480, 160)


def test_samples_per_split_from_train_samples() -> None:
    assert samples_per_split(
        train_samples=1000, global_batch_size=10, eval_interval=50, eval_iters=2
    ) == (1000, 60, 20)


def test_no_evaluation() -> None:
    assert samples_per_split(
        train_iters=10, global_batch_size=4, eval_interval=5, eval_iters=0
    ) == (40, 0, 0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"global_batch_size": 0, "eval_interval": 1, "eval_iters": 1, "train_iters": 1},
        {"global_batch_size": 1, "eval_interval": 0, "eval_iters": 1, "train_iters": 1},
        {"global_batch_size": 1, "eval_interval": 1, "eval_iters": -1, "train_iters": 1},
        {"global_batch_size": 1, "eval_interval": 1, "eval_iters": 1},
    ],
)
def test_sample_count_errors(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        samples_per_split(**kwargs)
