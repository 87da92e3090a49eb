"""Sentence splitting: Megatron's punkt setup, where the model comes from, spaCy fallback."""

from __future__ import annotations

import json

import pytest

from mg.core.fixtures import fixture_path
from mg.corpus_prep import splitter
from mg.corpus_prep.cli import main
from mg.corpus_prep.splitter import (
    MEGATRON_SPLIT_PIECE,
    PunktSplitter,
    SplitterError,
    build_splitter,
    load_punkt_tab,
    resolve_splitter,
)
from mg.indexed_dataset.format import IndexedDataset

TEXT = "Mr. Smith went to Washington. He saw the U.S. Capitol.\n\nThen he left.  Bye."


@pytest.fixture
def nltk_cache(tmp_path, monkeypatch):
    """An empty private punkt cache, and no punkt data on NLTK's own path."""
    monkeypatch.setenv("MG_NLTK_DATA", str(tmp_path / "nltk_data"))
    monkeypatch.setattr(splitter, "find_installed_punkt", lambda lang: None)
    return tmp_path / "nltk_data"


def no_sample(limit: int) -> str:
    raise AssertionError("the corpus should not be sampled")


def test_english_comes_from_the_fixture_installed_once_into_the_cache(nltk_cache, monkeypatch):
    warnings: list[str] = []
    spec = resolve_splitter("nltk", "english", False, no_sample, warnings.append)
    assert spec.punkt_dir == str(nltk_cache / "tokenizers" / "punkt_tab" / "english")
    assert warnings == []

    def refuse(folder):
        raise AssertionError("installed twice")

    monkeypatch.setattr(splitter, "install_fixture_punkt", refuse)
    again = resolve_splitter("nltk", "english", False, no_sample, warnings.append)
    assert again.punkt_dir == spec.punkt_dir
    assert build_splitter(spec).split(TEXT) == [
        "Mr. Smith went to Washington.",
        "He saw the U.S. Capitol.",
        "Then he left.",
        "Bye.",
    ]


def test_keep_newlines_keeps_the_whitespace_after_each_sentence(nltk_cache):
    spec = resolve_splitter("nltk", "english", True, no_sample, print)
    assert build_splitter(spec).split(TEXT) == [
        "Mr. Smith went to Washington. ",
        "He saw the U.S. Capitol.\n\n",
        "Then he left.  ",
        "Bye.",
    ]


def test_without_any_model_punkt_is_trained_on_the_corpus_with_a_warning(nltk_cache, monkeypatch):
    def offline(folder):
        raise OSError("no network")

    monkeypatch.setattr(splitter, "install_fixture_punkt", offline)
    text = fixture_path("botchan", "botchan.txt").read_text(encoding="utf-8")
    asked: list[int] = []

    def sample(limit: int) -> str:
        asked.append(limit)
        return text[:limit]

    warnings: list[str] = []
    spec = resolve_splitter("nltk", "english", False, sample, warnings.append)
    assert spec.punkt_params is not None and asked
    assert "could not install the punkt_tab English fixture (no network)" in warnings[0]
    assert "trained a Punkt model on the first" in warnings[1]
    assert len(build_splitter(spec).split("It rained. We stayed in.")) == 2
    # a language we have no model for at all
    warnings.clear()
    spec = resolve_splitter("nltk", "klingon", False, sample, warnings.append)
    assert spec.punkt_params is not None and "--lang klingon" in warnings[0]


def test_a_language_name_that_is_a_path_is_refused(nltk_cache):
    with pytest.raises(SplitterError, match="not a language name"):
        resolve_splitter("nltk", "../english", False, no_sample, print)
    with pytest.raises(SplitterError, match="expected 'nltk' or 'spacy:<pipeline>'"):
        resolve_splitter("stanza", "english", False, no_sample, print)


def test_text_is_split_in_megatron_pieces_of_a_million_characters(nltk_cache):
    spec = resolve_splitter("nltk", "english", False, no_sample, print)
    params = load_punkt_tab(spec.punkt_dir)
    words = "word " * (MEGATRON_SPLIT_PIECE // 5)  # one sentence across the piece boundary
    text = words + "more words. Last one."
    sentences = PunktSplitter(params, keep_newlines=False).split(text)
    assert sentences[0] == words.rstrip() and len(sentences[0]) == MEGATRON_SPLIT_PIECE - 1
    assert sentences[1:] == ["more words.", "Last one."]


def test_spacy_pipeline_not_installed_falls_back_to_blank_sentencizer():
    warnings: list[str] = []
    spec = resolve_splitter("spacy:en_core_web_sm", "english", False, no_sample, warnings.append)
    assert spec.kind == "spacy" and spec.spacy_pipeline is None and spec.spacy_lang == "en"
    assert "'en_core_web_sm' is not installed" in warnings[0]
    assert "spacy.blank('en')" in warnings[0]
    sentences = build_splitter(spec).split("Hello there. How are you?\n\nFine.")
    assert sentences == ["Hello there.", "How are you?", "Fine."]
    kept = build_splitter(
        resolve_splitter("spacy:en_core_web_sm", "english", True, no_sample, warnings.append)
    )
    assert kept.split("Hello there. How are you?\n\nFine.") == [
        "Hello there. ",
        "How are you?\n\n",
        "Fine.",
    ]


def test_tokenize_with_spacy_and_with_a_trained_punkt(tmp_path, nltk_cache, capsys):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(
        "".join(json.dumps({"text": f"Sentence one of {i}. Sentence two! Three?"}) + "\n"
        for i in range(20))
    )  # fmt: skip
    gpt2 = [
        "--tokenizer-type", "GPT2BPETokenizer",
        "--vocab-file", fixture_path("gpt2-bpe", "vocab.json"),
        "--merge-file", fixture_path("gpt2-bpe", "merges.txt"),
    ]  # fmt: skip
    for name, extra in [
        ("spacy", ["--sentence-splitter", "spacy:en_core_web_sm"]),
        ("trained", ["--lang", "klingon"]),
    ]:
        args = ["tokenize", "--input", corpus, "--output-prefix", tmp_path / name, *gpt2]
        args += ["--split-sentences", *extra, "--workers", "1", "--no-progress-bar"]
        with pytest.raises(SystemExit) as exit_:
            main([str(a) for a in args])
        assert exit_.value.code == 0
        dataset = IndexedDataset(str(tmp_path / f"{name}_text_sentence"))
        assert dataset.num_documents == 20 and len(dataset) >= 40, name
    err = capsys.readouterr().err
    assert "is not installed; splitting with spacy.blank('en')" in err
    assert "no NLTK punkt_tab model for --lang klingon" in err
