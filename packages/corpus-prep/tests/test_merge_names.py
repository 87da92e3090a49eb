"""Which dataset `mg-prep merge --input NAME` reads, and what it says when it replaces one."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mg.core.fixtures import fixture_path
from mg.corpus_prep.cli import main
from mg.indexed_dataset import IndexedDataset, IndexedDatasetBuilder


def build(prefix, documents: list[list[int]]) -> str:
    with IndexedDatasetBuilder(f"{prefix}.bin", np.uint16) as builder:
        for tokens in documents:
            builder.add_document(tokens, [len(tokens)])
        builder.finalize(f"{prefix}.idx")
    return str(prefix)


def run(*argv: str) -> int:
    with pytest.raises(SystemExit) as stop:
        main([*argv])
    return stop.value.code


def documents_of(prefix) -> list[list[int]]:
    with IndexedDataset(str(prefix)) as dataset:
        return [dataset[i].tolist() for i in range(len(dataset))]


def test_a_dataset_beside_a_folder_of_the_same_name_is_the_dataset(tmp_path, capsys) -> None:
    """mg-train keeps its index cache in PREFIX/cache/: merging after training still works."""
    data = build(tmp_path / "corpus", [[1, 2], [3]])
    (tmp_path / "corpus" / "cache").mkdir(parents=True)
    (tmp_path / "corpus" / "cache" / "index.npy").write_bytes(b"x")
    other = build(tmp_path / "other", [[4]])
    assert run("merge", "--input", data, other, "--output-prefix", str(tmp_path / "out")) == 0
    assert documents_of(tmp_path / "out") == [[1, 2], [3], [4]]
    err = capsys.readouterr().err
    assert f"{data} is a dataset ({data}.bin/.idx) and a folder; merging the dataset" in err


def test_a_folder_named_with_its_slash_is_the_folder(tmp_path, capsys) -> None:
    build(tmp_path / "parts", [[9]])
    (tmp_path / "parts").mkdir()
    build(tmp_path / "parts" / "a", [[1]])
    build(tmp_path / "parts" / "b", [[2]])
    folder = str(tmp_path / "parts") + "/"
    assert run("merge", "--input", folder, "--output-prefix", str(tmp_path / "out")) == 0
    assert documents_of(tmp_path / "out") == [[1], [2]]
    assert "and a folder" not in capsys.readouterr().err


def test_merge_says_it_replaced_an_existing_dataset(tmp_path, capsys) -> None:
    a = build(tmp_path / "a", [[1]])
    out = str(tmp_path / "out")
    assert run("merge", "--input", a, "--output-prefix", out) == 0
    assert "replaced the existing" not in capsys.readouterr().out
    assert run("merge", "--input", a, a, "--output-prefix", out) == 0
    assert f"mg-prep merge: replaced the existing {out}.bin/.idx" in capsys.readouterr().out
    assert documents_of(out) == [[1], [1]]


def test_tokenize_says_it_replaced_an_existing_dataset(tmp_path, capsys) -> None:
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"text": "hello world"}) + "\n")
    gpt2 = fixture_path("gpt2-bpe", "vocab.json")
    argv = ["tokenize", "--input", str(corpus), "--output-prefix", str(tmp_path / "out"),
            "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(gpt2),
            "--merge-file", str(gpt2.with_name("merges.txt")), "--workers", "0"]  # fmt: skip
    assert run(*argv) == 0
    assert "replaced the existing" not in capsys.readouterr().err
    assert run(*argv) == 0
    out = tmp_path / "out_text_document"
    assert f"  replaced the existing {out}.bin/.idx" in capsys.readouterr().err
