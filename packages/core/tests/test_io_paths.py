"""The output-vs-input check: equal, above, below, through symbolic links and globs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mg.core.io_paths import output_clash, relation


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    (tmp_path / "runs" / "ckpt").mkdir(parents=True)
    (tmp_path / "runs" / "ckpt" / "model.pt").write_bytes(b"x")
    (tmp_path / "other").mkdir()
    return tmp_path


def test_relations(tree: Path) -> None:
    ckpt = tree / "runs" / "ckpt"
    assert relation(ckpt, ckpt) == "is"
    assert relation(str(ckpt) + "/", ckpt) == "is"
    assert relation(tree / "runs" / "ckpt" / ".." / "ckpt", ckpt) == "is"
    assert relation(tree / "runs", ckpt) == "contains"
    assert relation(tree, ckpt) == "contains"
    assert relation(ckpt / "q", ckpt) == "inside"
    assert relation(tree / "other", ckpt) is None
    assert relation(tree / "runs" / "ckpt-q", ckpt) is None  # a sibling sharing a prefix
    assert relation(ckpt / "model.pt", ckpt / "model.pt") == "is"


def test_symbolic_links_and_hard_links(tree: Path) -> None:
    ckpt = tree / "runs" / "ckpt"
    (tree / "alias").symlink_to(ckpt)
    (tree / "parent-alias").symlink_to(tree / "runs")
    assert relation(tree / "alias", ckpt) == "is"
    assert relation(tree / "parent-alias", ckpt) == "contains"
    assert relation(tree / "alias" / "q", ckpt) == "inside"
    os.link(ckpt / "model.pt", tree / "other" / "linked.pt")
    assert relation(tree / "other" / "linked.pt", ckpt / "model.pt") == "is"


def test_message_names_both_flags_in_one_line(tree: Path) -> None:
    ckpt = tree / "runs" / "ckpt"
    message = output_clash([("--save", tree / "runs")], [("--load", ckpt)])
    assert message is not None and "\n" not in message
    assert message.startswith(f"--save {tree / 'runs'} contains the input --load {ckpt}")
    assert "choose a --save outside --load" in message
    same = output_clash([("--save", ckpt)], [("--load", ckpt)])
    assert same is not None and f"--save {ckpt} is the input --load {ckpt}" in same


def test_unset_flags_and_apart_paths_pass(tree: Path) -> None:
    ckpt = tree / "runs" / "ckpt"
    assert output_clash([("--save", tree / "other" / "q")], [("--load", ckpt)]) is None
    assert output_clash([("--report", None)], [("--load", ckpt)]) is None
    assert output_clash([("--save", ckpt)], [("--calib-data-path", None)]) is None


def test_a_folder_written_into_may_hold_an_input(tree: Path) -> None:
    """Files written into a folder above the input replace nothing; the folder itself or
    one inside the input still clash."""
    ckpt = tree / "runs" / "ckpt"
    assert output_clash([("--output-dir", tree)], [("--input", ckpt)], files_into=True) is None
    assert output_clash([("--output-dir", ckpt)], [("--input", ckpt)], files_into=True)
    assert output_clash([("--output-dir", ckpt / "t")], [("--input", ckpt)], files_into=True)


def test_globs_expand_to_their_matches(tree: Path) -> None:
    (tree / "other" / "a.jsonl").write_text("{}\n")
    message = output_clash(
        [("--output", tree / "other" / "a.jsonl")], [("--input", str(tree / "other" / "*.jsonl"))]
    )
    assert message is not None
    assert f"--input {tree / 'other' / '*.jsonl'} ({tree / 'other' / 'a.jsonl'})" in message
