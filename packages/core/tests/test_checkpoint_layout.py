"""Names on disk match Megatron-LM's get_checkpoint_name; pointer parsing; layout detection."""

from pathlib import Path

import pytest

from mg.core.checkpoint import (
    CheckpointError,
    Layout,
    checkpoint_dir,
    checkpoint_file,
    detect_layout,
    list_iterations,
    read_latest_iteration,
)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        # Hand-written from megatron/training/checkpointing.py::get_checkpoint_name
        ({"tp_rank": 0}, "s/iter_0000200/mp_rank_00/model_optim_rng.pt"),
        ({"tp_rank": 3}, "s/iter_0000200/mp_rank_03/model_optim_rng.pt"),
        (
            {"tp_rank": 1, "pp_rank": 0, "pp_size": 1},
            "s/iter_0000200/mp_rank_01/model_optim_rng.pt",
        ),
        (
            {"tp_rank": 1, "pp_rank": 2, "pp_size": 4},
            "s/iter_0000200/mp_rank_01_002/model_optim_rng.pt",
        ),
        (
            {"tp_rank": 1, "pp_rank": 2, "pp_size": 4, "ep_rank": 5, "ep_size": 8},
            "s/iter_0000200/mp_rank_01_002_005/model_optim_rng.pt",
        ),
        # PP = 1, EP > 1: Megatron puts the expert rank where the pipeline rank would be
        (
            {"tp_rank": 0, "ep_rank": 3, "ep_size": 4},
            "s/iter_0000200/mp_rank_00_003/model_optim_rng.pt",
        ),
        (
            {"tp_rank": 12, "pp_rank": 10, "pp_size": 16},
            "s/iter_0000200/mp_rank_12_010/model_optim_rng.pt",
        ),
    ],
)
def test_checkpoint_file_matches_megatron(kwargs: dict, expected: str) -> None:
    assert checkpoint_file("s", 200, **kwargs).as_posix() == expected


def test_checkpoint_dir_and_release() -> None:
    assert checkpoint_dir("s", 7).as_posix() == "s/iter_0000007"
    assert checkpoint_dir("s", 12345678).as_posix() == "s/iter_12345678"
    assert checkpoint_dir("s", 7, release=True).as_posix() == "s/release"
    assert checkpoint_dir("s", "release").as_posix() == "s/release"
    assert (
        checkpoint_file("s", 0, release=True).as_posix()
        == "s/release/mp_rank_00/model_optim_rng.pt"
    )
    with pytest.raises(ValueError):
        checkpoint_dir("s", -1)
    with pytest.raises(ValueError):
        checkpoint_dir("s", "latest")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("200", 200),
        ("200\n", 200),
        ("  42  \n", 42),
        ("release", "release"),
        ("release\n", "release"),
    ],
)
def test_read_latest_iteration(tmp_path: Path, text: str, expected: object) -> None:
    (tmp_path / "latest_checkpointed_iteration.txt").write_text(text)
    assert read_latest_iteration(tmp_path) == expected


def test_read_latest_missing(tmp_path: Path) -> None:
    assert read_latest_iteration(tmp_path) is None


@pytest.mark.parametrize("text", ["", "abc", "0", "-5", "iter_0000200", "1.5"])
def test_read_latest_invalid(tmp_path: Path, text: str) -> None:
    tracker = tmp_path / "latest_checkpointed_iteration.txt"
    tracker.write_text(text)
    with pytest.raises(CheckpointError, match="latest_checkpointed_iteration.txt") as info:
        read_latest_iteration(tmp_path)
    assert str(tracker) in str(info.value)


def _touch(root: Path, *names: str) -> None:
    for name in names:
        path = root / name / "model_optim_rng.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")


def test_list_iterations_ignores_partial(tmp_path: Path) -> None:
    for name in ["iter_0000100", "iter_0000020", "iter_0000300.tmp", "iter_0000100.old", "release"]:
        (tmp_path / name).mkdir()
    (tmp_path / "iter_0000400").write_text("a file, not a folder")
    assert list_iterations(tmp_path) == [20, 100]
    assert list_iterations(tmp_path / "nope") == []


def test_detect_layout(tmp_path: Path) -> None:
    _touch(tmp_path / "a", "mp_rank_00", "mp_rank_01")
    assert detect_layout(tmp_path / "a") == Layout(tp=2, pp=1)
    _touch(tmp_path / "b", *[f"mp_rank_{t:02d}_{p:03d}" for t in range(2) for p in range(3)])
    assert detect_layout(tmp_path / "b") == Layout(tp=2, pp=3)
    assert detect_layout(tmp_path / "b", second_is_expert=True) == Layout(tp=2, pp=1, ep=3)
    _touch(tmp_path / "c", *[f"mp_rank_00_{p:03d}_{e:03d}" for p in range(2) for e in range(4)])
    assert detect_layout(tmp_path / "c") == Layout(tp=1, pp=2, ep=4)
    (tmp_path / "d" / "mp_rank_00").mkdir(parents=True)  # folder without its file
    assert detect_layout(tmp_path / "d") is None
    assert str(Layout(tp=2, pp=3)) == "TP=2, PP=3"
