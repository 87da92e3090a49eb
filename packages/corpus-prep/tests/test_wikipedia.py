"""`mg-prep wikipedia`: a dump to JSON lines through WikiExtractor, plain or bz2 alike."""

from __future__ import annotations

import bz2
import json
import shutil

import pytest

from mg.core.fixtures import fixture_path
from mg.corpus_prep.cli import main

pytest.importorskip("wikiextractor")

DUMP = fixture_path("enwiki-excerpt", "enwiki-excerpt.xml")


def mg_prep(*args: object) -> int:
    try:
        main([str(a) for a in args])
    except SystemExit as exit_:
        return int(exit_.code or 0)
    return 0


def test_a_dump_and_its_bz2_give_the_same_articles_in_order(tmp_path):
    packed = tmp_path / "enwiki-pages-articles1.xml.bz2"
    packed.write_bytes(bz2.compress(DUMP.read_bytes()))
    plain = tmp_path / "plain.jsonl"
    assert mg_prep("wikipedia", "--input", DUMP, "--output", plain, "--no-templates") == 0
    assert (
        mg_prep(
            "wikipedia", "--input", packed, "--output", tmp_path / "bz2.jsonl", "--no-templates"
        )
        == 0
    )
    assert plain.read_bytes() == (tmp_path / "bz2.jsonl").read_bytes()
    articles = [json.loads(line) for line in plain.read_text(encoding="utf-8").splitlines()]
    assert len(articles) == 106
    assert articles[0]["title"] == "Anarchism" and articles[0]["id"] == "12"
    assert articles[0]["text"].startswith("Anarchism is a political philosophy")
    assert "[[" not in articles[0]["text"] and "{{" not in articles[0]["text"]
    assert not list(tmp_path.glob("*.tmp"))


def test_the_output_tokenizes(tmp_path):
    wiki = tmp_path / "wiki.jsonl"
    shutil.copy(DUMP, tmp_path / "dump.xml")
    assert (
        mg_prep("wikipedia", "--input", tmp_path / "dump.xml", "--output", wiki, "--no-templates")
        == 0
    )
    code = mg_prep(
        "tokenize", "--input", wiki, "--output-prefix", tmp_path / "wiki", "--json-keys", "text",
        "--tokenizer-type", "GPT2BPETokenizer",
        "--vocab-file", fixture_path("gpt2-bpe", "vocab.json"),
        "--merge-file", fixture_path("gpt2-bpe", "merges.txt"),
        "--workers", 0, "--no-progress-bar",
    )  # fmt: skip
    assert code == 0
    assert (tmp_path / "wiki_text_document.idx").stat().st_size > 1000


def test_mistakes_are_one_line_errors(tmp_path, capsys):
    assert mg_prep("wikipedia", "--input", tmp_path / "none.xml", "--output", tmp_path / "o") == 2
    assert "--input" in capsys.readouterr().err
    assert mg_prep("wikipedia", "--input", DUMP, "--output", tmp_path / "o", "--processes", 0) == 2
    assert "--processes 0: must be 1 or more" in capsys.readouterr().err
    out = tmp_path / "nofolder" / "o.jsonl"
    assert mg_prep("wikipedia", "--input", DUMP, "--output", out) == 2
    assert "is not a writable folder" in capsys.readouterr().err
