"""`mg-prep merge`: Megatron's merge_datasets.py order, explicit prefixes, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mg.core.fixtures import fixture_path
from mg.corpus_prep.cli import main
from mg.indexed_dataset.format import IndexedDatasetBuilder

GPT2 = [
    "--tokenizer-type", "GPT2BPETokenizer",
    "--vocab-file", str(fixture_path("gpt2-bpe", "vocab.json")),
    "--merge-file", str(fixture_path("gpt2-bpe", "merges.txt")),
]  # fmt: skip


def mg_prep(*args: object) -> int:
    try:
        main([str(a) for a in args])
    except SystemExit as exit_:
        return int(exit_.code or 0)
    return 0


def write_corpus(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return path


def files_of(prefix: Path) -> tuple[bytes, bytes]:
    return Path(f"{prefix}.bin").read_bytes(), Path(f"{prefix}.idx").read_bytes()


@pytest.fixture
def parts(tmp_path) -> tuple[Path, list[list[str]]]:
    """Three datasets named so that string order differs from numeric order."""
    folder = tmp_path / "parts"
    folder.mkdir()
    texts = [[f"part {n} document {i}." for i in range(n + 1)] for n in (2, 10, 1)]
    for n, chunk in zip((2, 10, 1), texts, strict=True):
        corpus = write_corpus(tmp_path / f"c{n}.jsonl", chunk)
        args = ["tokenize", "--input", corpus, "--output-prefix", folder / f"part_{n}", *GPT2]
        assert mg_prep(*args, "--append-eod", "--workers", 0, "--no-progress-bar") == 0
    return folder, texts


def test_a_folder_merges_in_sorted_name_order_like_megatron(parts, tmp_path, capsys):
    folder, texts = parts
    assert mg_prep("merge", "--input", folder, "--output-prefix", tmp_path / "out" / "all") == 0
    assert "3 datasets" in capsys.readouterr().out
    # sorted names: part_10, part_1, part_2 -> the same as tokenizing that concatenation
    order = {"part_1_text_document": 1, "part_10_text_document": 10, "part_2_text_document": 2}
    by_n = {2: texts[0], 10: texts[1], 1: texts[2]}
    ordered = [t for name in sorted(order) for t in by_n[order[name]]]
    whole = write_corpus(tmp_path / "whole.jsonl", ordered)
    args = ["tokenize", "--input", whole, "--output-prefix", tmp_path / "whole", *GPT2]
    assert mg_prep(*args, "--append-eod", "--workers", 0, "--no-progress-bar") == 0
    assert files_of(tmp_path / "out" / "all") == files_of(tmp_path / "whole_text_document")


def test_explicit_prefixes_merge_in_the_order_given(parts, tmp_path):
    folder, _ = parts
    a, b = folder / "part_2_text_document", folder / "part_1_text_document.idx"
    assert mg_prep("merge", "--input", a, b, "--output-prefix", tmp_path / "ab") == 0
    assert mg_prep("merge", "--input", str(b)[:-4], a, "--output-prefix", tmp_path / "ba") == 0
    assert files_of(tmp_path / "ab") != files_of(tmp_path / "ba")
    assert len(files_of(tmp_path / "ab")[0]) == len(files_of(tmp_path / "ba")[0])


@pytest.mark.compat
def test_same_bytes_as_megatron_core_merge(parts, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder as CoreBuilder

    folder, _ = parts
    prefixes = sorted(p.with_suffix("") for p in folder.glob("*.idx"))
    builder = CoreBuilder(str(tmp_path / "core.bin"), dtype=np.uint16)
    for prefix in prefixes:
        builder.add_index(str(prefix))
    builder.finalize(str(tmp_path / "core.idx"))
    assert mg_prep("merge", "--input", folder, "--output-prefix", tmp_path / "ours") == 0
    assert files_of(tmp_path / "ours") == files_of(tmp_path / "core")


def test_the_output_inside_the_input_folder_is_not_merged_into_itself(parts):
    folder, _ = parts
    output = folder / "merged"
    assert mg_prep("merge", "--input", folder, "--output-prefix", output) == 0
    first = files_of(output)
    assert mg_prep("merge", "--input", folder, "--output-prefix", output) == 0
    assert files_of(output) == first


def test_different_dtypes_are_a_clear_error_and_nothing_is_written(parts, tmp_path, capsys):
    folder, _ = parts
    with IndexedDatasetBuilder(str(folder / "wide.bin"), np.int32) as builder:
        builder.add_document([1, 2, 3], [3])
        builder.finalize(str(folder / "wide.idx"))
    assert mg_prep("merge", "--input", folder, "--output-prefix", tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert "mg-prep merge: error:" in err and "int32" in err and "uint16" in err
    assert "Traceback" not in err
    assert not list(tmp_path.glob("out*"))


@pytest.mark.parametrize("missing", [".idx", ".bin"])
def test_a_half_dataset_in_the_folder_is_an_error(parts, tmp_path, capsys, missing):
    folder, _ = parts
    (folder / f"part_1_text_document{missing}").unlink()
    assert mg_prep("merge", "--input", folder, "--output-prefix", tmp_path / "out") == 2
    assert f"part_1_text_document{missing}" in capsys.readouterr().err


def test_inputs_that_are_not_datasets(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert mg_prep("merge", "--input", tmp_path / "empty", "--output-prefix", tmp_path / "o") == 2
    assert "holds no .bin/.idx datasets" in capsys.readouterr().err
    assert mg_prep("merge", "--input", tmp_path / "nope", "--output-prefix", tmp_path / "o") == 2
    assert "not a folder or a dataset prefix" in capsys.readouterr().err
