"""Megatron's WikiText detokenizer on WikiText-103's real markup; expected strings by hand."""

import pytest

from mg.evaluate.detokenizer import wikitext_detokenize
from mg.evaluate.wikitext import count_original_words

CASES = [
    # number separators and hyphenated words
    ("the well @-@ known 1 @,@ 000 men , 3 @.@ 5 km", "the well-known 1,000 men, 3.5 km"),
    # headings of every level (real lines end in ' \n')
    (" = Valkyria Chronicles III = \n", " = Valkyria Chronicles III =\n"),
    (" = = Gameplay = = \n", " == Gameplay ==\n"),
    (" = = = Development = = = \n", " === Development ===\n"),
    (" = = = = Music = = = = \n", " ==== Music ====\n"),
    # brackets, with the punctuation inside them
    (
        "Valkyria 3 ( Japanese : 戦場のヴァルキュリア3 , lit . Valkyria of the Battlefield 3 ) is",
        "Valkyria 3 (Japanese: 戦場のヴァルキュリア3, lit. Valkyria of the Battlefield 3) is",
    ),
    ("see [ 1 ] and { x }", "see [1] and {x}"),
    # possessive 's and plural possessive s '
    ("the game 's story", "the game's story"),
    ("the players ' union", "the players' union"),
    # quotes
    ('He said " hello there " to them', 'He said "hello there" to them'),
    # Megatron's quirk, kept on purpose: the final " 's" rule then eats the space
    # before a quoted word starting with s
    ("a ' single quoted ' word", "a'single quoted' word"),
    ("an ' old quoted ' word", "an 'old quoted' word"),
    # punctuation spacing; a final ' .' without a space after it stays (Megatron's rule)
    ("Yes ! Really ? No ; maybe : fine . \n", "Yes! Really? No; maybe: fine.\n"),
    ("the end .", "the end ."),
    # degrees, N (a number placeholder) and line edges
    ("a 5 ° C rise of N per cent", "a 5°C rise of 1 per cent"),
    (" \n = Title = \n \n", "\n= Title =\n\n"),
]


@pytest.mark.parametrize("raw, expected", CASES)
def test_wikitext_detokenize(raw: str, expected: str) -> None:
    assert wikitext_detokenize(raw) == expected


def test_detokenize_a_whole_wikitext_paragraph() -> None:
    raw = (
        " = = Reception = = \n \n The game sold 102 @,@ 000 copies in its first week , "
        'and reviewers praised its " world @-@ building " ( Famitsu : 33 @.@ 5 / 40 ) . \n'
    )
    expected = (
        " == Reception ==\n\nThe game sold 102,000 copies in its first week, "
        'and reviewers praised its "world-building" (Famitsu: 33.5 / 40).\n'
    )
    assert wikitext_detokenize(raw) == expected


def test_word_count_is_megatrons_split_on_single_spaces() -> None:
    raw = " = Title = \n \n A b c . \n"
    # strip → '= Title = \n \n A b c .' ; split(' ') → = Title = \n \n A b c .
    assert count_original_words(raw) == 9
