"""Each cleaning rule on crafted inputs, one at a time, then the `Cleaner` as a whole."""

from __future__ import annotations

import pytest

from mg.corpus_prep.cleaning import (
    Cleaner,
    CleanOptions,
    normalize_unicode,
    normalize_whitespace,
    repair,
    standardize_punctuation,
)

ONLY_REPAIR = CleanOptions(normalization="none", punctuation=False, whitespace=False)


def test_repair_undoes_mojibake():
    # UTF-8 bytes decoded as cp1252, once and twice over.
    assert repair("CafÃ© au lait") == "Café au lait"
    assert repair("The Mona Lisa doesnÃ¢â‚¬â„¢t have eyebrows.") == (
        "The Mona Lisa doesn\u2019t have eyebrows."
    )
    assert repair("Fish &amp; chips") == "Fish & chips"
    # repair leaves curly quotes and widths to the other rules
    assert repair("\u201cＡ\u201d") == "\u201cＡ\u201d"


def test_unicode_normalisation_forms():
    decomposed = "Cafe\u0301 \ufb01le ＡＢＣ"
    assert normalize_unicode(decomposed, "NFC") == "Caf\u00e9 \ufb01le ＡＢＣ"
    assert normalize_unicode(decomposed, "NFKC") == "Caf\u00e9 file ABC"
    assert normalize_unicode(decomposed, "none") == decomposed


def test_punctuation_quotes_dashes_ellipsis():
    text = "\u201cHi,\u201d she said \u2018twice\u2019 \u201elow\u201c \u00abgui\u00bb ``tex''"
    assert standardize_punctuation(text) == '"Hi," she said \'twice\' "low" "gui" "tex"'
    assert standardize_punctuation("1914\u20131918 \u22125 wait\u2014what\u2026") == (
        "1914-1918 -5 wait - what..."
    )


def test_whitespace():
    text = "\ufeff  a\u00a0\u00a0b\tc\u200bd  \r\nline two   \r\n\r\n\r\n\r\npara\u3000end  "
    assert normalize_whitespace(text) == "a b cd\nline two\n\npara end"
    # indentation survives; spaces after words and at line ends do not
    assert normalize_whitespace("def f():  \n\t  return  1 ") == "def f():\n   return 1"


def test_cleaner_applies_rules_in_order_and_reports_them():
    cleaner = Cleaner()
    text, reason = cleaner.clean("  It Ã¢â‚¬Å“worksÃ¢â‚¬\x9d\u2026 \u00a0mostly  ")
    assert (text, reason) == ('It "works"... mostly', None)
    result = cleaner.clean_fields(["Caf\u00c3\u00a9\u2014ok"])
    assert result.texts == ["Caf\u00e9 - ok"]
    assert result.changed_by == ("repair", "punctuation")


def test_rules_can_be_turned_off():
    cleaner = Cleaner(ONLY_REPAIR)
    assert cleaner.clean("CafÃ©  \u201cx\u201d") == ("Café  \u201cx\u201d", None)


@pytest.mark.parametrize(
    ("options", "text", "expected"),
    [
        (CleanOptions(min_chars=5), "abcd", "too_few_chars"),
        (CleanOptions(min_chars=5), "abcde", None),
        (CleanOptions(max_chars=5), "abcdef", "too_many_chars"),
        (CleanOptions(max_chars=5), "abcde", None),
        (CleanOptions(min_words=3), "one two", "too_few_words"),
        (CleanOptions(min_words=3), "one two three", None),
        (CleanOptions(max_words=2), "one two three", "too_many_words"),
        (CleanOptions(max_words=2), "one   two", None),
        (CleanOptions(), " \u200b\n\t ", "empty"),
        # lengths are measured after cleaning: four spaces collapse to one
        (CleanOptions(max_chars=3), "a    b", None),
    ],
)
def test_length_filters(options, text, expected):
    assert Cleaner(options).clean(text)[1] == expected


def test_exact_duplicates_dropped_first_copy_kept():
    cleaner = Cleaner(CleanOptions(dedup="exact"))
    outcomes = [
        cleaner.clean(t)[1]
        for t in ["Hello world.", "hello   WORLD.", "Hello world!", "\u201cHello world.\u201d"]
    ]
    assert outcomes == [None, "exact_duplicate", None, None]
    assert cleaner.clean("Hello\u00a0world.") == (None, "exact_duplicate")


def test_multiple_fields_dropped_together():
    cleaner = Cleaner(CleanOptions(min_words=2, dedup="exact"))
    assert cleaner.clean_fields(["a title", "body text here"]).texts == [
        "a title",
        "body text here",
    ]
    assert cleaner.clean_fields(["short", "body text here"]).reason == "too_few_words"
    assert cleaner.clean_fields(["a title", "body text here"]).reason == "exact_duplicate"
    # the same texts under other keys are another document
    assert cleaner.clean_fields(["body text here", "a title"]).reason is None


def test_bad_options_rejected():
    with pytest.raises(ValueError, match="min-chars"):
        CleanOptions(min_chars=10, max_chars=5)
    with pytest.raises(ValueError, match="NFC"):
        CleanOptions(normalization="NFD")  # type: ignore[arg-type]
