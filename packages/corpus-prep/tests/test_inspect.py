"""`mg-prep inspect`: counts, sizes, length histogram, decoded samples, clean errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from mg.core.fixtures import fixture_dir, fixture_path
from mg.corpus_prep.cli import main

GPT2 = [
    "--tokenizer-type", "GPT2BPETokenizer",
    "--vocab-file", str(fixture_path("gpt2-bpe", "vocab.json")),
    "--merge-file", str(fixture_path("gpt2-bpe", "merges.txt")),
]  # fmt: skip
TEXTS = ["Hello world", "", "The quick brown fox jumps over the lazy dog. " * 10, "Bye."]


def mg_prep(*args: object) -> int:
    try:
        main([str(a) for a in args])
    except SystemExit as exit_:
        return int(exit_.code or 0)
    return 0


@pytest.fixture
def dataset(tmp_path) -> Path:
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS), encoding="utf-8")
    args = ["tokenize", "--input", corpus, "--output-prefix", tmp_path / "d", *GPT2]
    assert mg_prep(*args, "--append-eod", "--workers", 0, "--no-progress-bar") == 0
    return tmp_path / "d_text_document"


def test_summary_histogram_and_decoded_samples(dataset, capsys):
    assert mg_prep("inspect", dataset, *GPT2, "--samples", 3) == 0
    out = capsys.readouterr().out
    assert "dtype       uint16 (2 bytes per token)" in out
    assert "documents   4 (1 empty)" in out
    assert "sequences   3 (0.75 per document)" in out
    assert "tokens      109" in out  # 2+1, nothing, 101+1, 3+1
    assert re.search(r"files       \.bin 218 B, \.idx \d+ B", out)
    assert "document length (tokens): min 0  p10 0  p50 3  p90 4  p99 4  max 102" in out
    assert re.search(r"^\s+0\s+1 #+$", out, re.M)  # the empty document
    assert re.search(r"^\s+64-127\s+1 #+$", out, re.M)
    assert "document 0 (1 sequence, 3 tokens):\n    | Hello world<|endoftext|>" in out
    assert "document 3 (1 sequence, 4 tokens):\n    | Bye.<|endoftext|>" in out
    assert "document 1 " not in out  # empty documents are not sampled


def test_json_output_and_ids_without_a_tokenizer(dataset, capsys):
    assert mg_prep("inspect", f"{dataset}.idx", "--json", "--samples", 1) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["documents"] == 4 and report["sequences"] == 3 and report["tokens"] == 109
    assert report["samples"] == [
        {"document": 0, "sequences": 1, "tokens": 3, "ids": [15496, 995, 50256]}
    ]


def test_sentence_level_datasets_show_the_sequence_lengths_too(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MG_NLTK_DATA", str(tmp_path / "nltk"))
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"text": "One. Two is longer. Three."}) + "\n")
    bert = ["--tokenizer-type", "BertWordPieceLowerCase"]
    bert += ["--vocab-file", str(fixture_dir("minilm-bert") / "vocab.txt")]
    args = ["tokenize", "--input", corpus, "--output-prefix", tmp_path / "s", *bert]
    assert mg_prep(*args, "--split-sentences", "--workers", 0, "--no-progress-bar") == 0
    capsys.readouterr()
    assert mg_prep("inspect", tmp_path / "s_text_sentence", *bert) == 0
    out = capsys.readouterr().out
    assert "sequences   3 (3.00 per document)" in out
    assert "sequence length (tokens): min 2" in out
    assert "    | one.\n    | two is longer.\n    | three." in out


@pytest.mark.parametrize("damage", ["truncate idx", "missing bin", "bad magic"])
def test_a_broken_dataset_is_reported_without_a_traceback(dataset, capsys, damage):
    idx, bin_ = Path(f"{dataset}.idx"), Path(f"{dataset}.bin")
    if damage == "truncate idx":
        idx.write_bytes(idx.read_bytes()[:40])
    elif damage == "missing bin":
        bin_.unlink()
    else:
        idx.write_bytes(b"NOTMMIDX" + idx.read_bytes()[8:])
    assert mg_prep("inspect", dataset) == 2
    err = capsys.readouterr().err
    assert err.startswith("mg-prep inspect: error: ") and str(dataset) in err
    assert "Traceback" not in err
