"""NLTK punkt_tab English data written from the punkt-english fixture, used by sent_tokenize."""

from __future__ import annotations

import pytest

from mg.core.fixtures import fixture_path
from mg.core.tokenizers.punkt import install_punkt_tab, read_punkt_module

nltk = pytest.importorskip("nltk")


@pytest.fixture(scope="module")
def nltk_data(tmp_path_factory):
    """An NLTK data folder holding only our punkt_tab, first on nltk.data.path."""
    folder = tmp_path_factory.mktemp("nltk_data")
    install_punkt_tab(folder)
    nltk.data.path.insert(0, str(folder))
    yield folder
    nltk.data.path.remove(str(folder))


def botchan_paragraphs() -> list[str]:
    """Paragraphs of Botchan: its hard-wrapped lines joined, blank-line separated."""
    text = fixture_path("botchan", "botchan.txt").read_text("utf-8-sig")
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("For the benefit"))
    return [" ".join(lines[start : start + 10]), " ".join(lines[start + 200 : start + 240])]


def test_install_writes_the_punkt_tab_layout(tmp_path):
    folder = install_punkt_tab(tmp_path)
    assert folder == tmp_path / "tokenizers" / "punkt_tab" / "english"
    names = {"abbrev_types.txt", "sent_starters.txt", "collocations.tab", "ortho_context.tab"}
    assert {p.name for p in folder.iterdir()} == names
    assert "mr" in (folder / "abbrev_types.txt").read_text("utf-8").split("\n")
    assert install_punkt_tab(tmp_path) == folder  # idempotent


def test_written_files_load_back_losslessly(nltk_data):
    """NLTK's own loader reads back exactly the parameters of the module."""
    from nltk.tokenize.punkt import load_punkt_params

    module = read_punkt_module(fixture_path("punkt-english", "english.py"))
    params = load_punkt_params(nltk.data.find("tokenizers/punkt_tab/english/"))
    assert params.abbrev_types == module["ABBREV_TYPES"]
    assert params.sent_starters == module["SENT_STARTERS"]
    assert params.collocations == module["COLLOCATIONS"]
    assert dict(params.ortho_context) == module["ORTHO_CONTEXT"]
    assert len(module["ORTHO_CONTEXT"]) > 10_000


def test_sent_tokenize_splits_botchan_sensibly(nltk_data):
    from nltk.tokenize.punkt import PunktTokenizer

    first, second = botchan_paragraphs()
    sentences = nltk.tokenize.sent_tokenize(first, language="english")
    assert sentences[0].startswith("For the benefit of those who may not know the original")
    # "Mr. K. Natsume" is one sentence: abbreviations and initials do not end it.
    assert any("by the late Mr. K. Natsume was an epoch-making" in s for s in sentences)
    assert all(s[0].isupper() or s[0] in "\"'" for s in sentences)
    assert len(sentences) >= 4
    tokenizer = PunktTokenizer("english")
    for paragraph in (first, second):
        assert nltk.tokenize.sent_tokenize(paragraph) == tokenizer.tokenize(paragraph)
    assert " ".join(nltk.tokenize.sent_tokenize(second)) == " ".join(second.split())


def test_abbreviations_and_initials(nltk_data):
    text = "Mr. Smith arrived at 3 p.m. on Jan. 5. He met Dr. J. R. Kennedy. Then he left."
    assert nltk.tokenize.sent_tokenize(text) == [
        "Mr. Smith arrived at 3 p.m. on Jan. 5.",
        "He met Dr. J. R. Kennedy.",
        "Then he left.",
    ]


def test_rejects_a_module_that_is_not_a_model(tmp_path):
    bogus = tmp_path / "english.py"
    bogus.write_text("ABBREV_TYPES = frozenset(('mr',))\n", encoding="utf-8")
    with pytest.raises(ValueError, match="not a punkt model module"):
        install_punkt_tab(tmp_path / "data", model_module=bogus)
    bogus.write_text(
        "ABBREV_TYPES = __import__('os').getcwd()\nSENT_STARTERS = set()\n"
        "COLLOCATIONS = set()\nORTHO_CONTEXT = {}\n",
        encoding="utf-8",
    )
    with pytest.raises(ValueError, match="not a literal"):
        read_punkt_module(bogus)
