"""`--output-shards N`: the single dataset cut at document boundaries, and its blend."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from mg.core.fixtures import fixture_path
from mg.corpus_prep.cli import main
from mg.corpus_prep.output_shards import TooFewDocumentsError, cut_points
from mg.corpus_prep.sample_corpus import real_corpus, write_jsonl
from mg.indexed_dataset.format import IndexedDataset, IndexedDatasetBuilder
from mg.indexed_dataset.split import read_blend_file

GPT2 = [
    "--tokenizer-type", "GPT2BPETokenizer",
    "--vocab-file", fixture_path("gpt2-bpe", "vocab.json"),
    "--merge-file", fixture_path("gpt2-bpe", "merges.txt"),
]  # fmt: skip


def tokenize(*args: object) -> int:
    try:
        main(["tokenize", *(str(a) for a in args), "--no-progress-bar", "--workers", "1"])
    except SystemExit as exit_:
        return int(exit_.code or 0)
    return 0


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("shards") / "corpus.jsonl"
    write_jsonl(path, itertools.islice(real_corpus(wikipedia_pages=0), 40))
    with open(path, "a", encoding="utf-8") as out:  # empty documents, some at the end
        out.write(json.dumps({"text": ""}) + "\n" + json.dumps({"text": ""}) + "\n")
    return path


def test_cut_points_balance_tokens_and_give_every_shard_tokens():
    tokens = np.array([10, 0, 10, 10, 0, 0, 10, 0])
    assert cut_points(tokens, 4) == [0, 1, 3, 4, 8]
    assert cut_points(tokens, 1) == [0, 8]
    assert cut_points(np.array([100, 1, 1]), 3) == [0, 1, 2, 3]  # one each, however uneven
    with pytest.raises(TooFewDocumentsError):
        cut_points(tokens, 5)


@pytest.mark.parametrize("split", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_shards_concatenate_to_the_unsharded_dataset(corpus, tmp_path, split):
    flags = [*GPT2, "--append-eod", *(["--split-sentences"] if split else [])]
    level = "sentence" if split else "document"
    assert tokenize("--input", corpus, "--output-prefix", tmp_path / "whole", *flags) == 0
    assert tokenize("--input", corpus, "--output-prefix", tmp_path / "cut", *flags,
                    "--output-shards", 3) == 0  # fmt: skip
    whole = tmp_path / f"whole_text_{level}"
    names = [tmp_path / f"cut_text_{level}_{i:05d}_of_00003" for i in range(3)]
    assert sorted(p.name for p in tmp_path.glob("cut*")) == sorted(
        [f"{n.name}{s}" for n in names for s in (".bin", ".idx")] + [f"cut_text_{level}.blend.txt"]
    )
    # merged back in order: the unsharded files, byte for byte
    with IndexedDatasetBuilder(tmp_path / "merged.bin", np.uint16) as builder:
        for name in names:
            builder.add_index(name)
        builder.finalize(tmp_path / "merged.idx")
    assert (tmp_path / "merged.bin").read_bytes() == Path(f"{whole}.bin").read_bytes()
    assert (tmp_path / "merged.idx").read_bytes() == Path(f"{whole}.idx").read_bytes()
    # the blend: each shard weighted by its tokens, readable as --data-args-path
    blend = read_blend_file(tmp_path / f"cut_text_{level}.blend.txt")
    assert list(blend.prefixes) == [str(n) for n in names]
    sizes = []
    for name in names:
        with IndexedDataset(name) as shard:
            sizes.append(int(shard.sequence_lengths.sum()))
            assert shard.num_documents > 0
    assert list(blend.weights) == sizes
    with IndexedDataset(whole) as dataset:
        assert sum(sizes) == int(dataset.sequence_lengths.sum())
        assert max(sizes) < 0.5 * sum(sizes)  # about a third each


def test_more_shards_than_documents_is_one_line_and_leaves_nothing(corpus, tmp_path, capsys):
    small = tmp_path / "small.jsonl"
    small.write_text('{"text": "one"}\n{"text": "two"}\n')
    out = tmp_path / "out" / "o"
    assert tokenize("--input", small, "--output-prefix", out, *GPT2, "--output-shards", 3) == 2
    err = capsys.readouterr().err
    assert "--output-shards 3: " in err and "2 documents with tokens" in err
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists()
