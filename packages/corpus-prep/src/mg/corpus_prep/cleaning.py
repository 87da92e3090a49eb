"""Text repair and document filters: the `mg-prep clean` rules, reusable by `tokenize`.

A `Cleaner` turns raw document text into training text in a fixed order, each
step behind its own switch so that a step can be turned off (and tested) on
its own:

1. **repair** with ftfy: mojibake (UTF-8 read as cp1252/latin-1), HTML
   entities, terminal escapes, C1 controls, surrogates. Run with quote
   uncurling, width folding and normalisation *off*: those are rules 2 and 3,
   which the user controls separately.
2. **unicode normalisation**: NFC (default, lossless) or NFKC (folds
   compatibility forms: full-width letters, ligatures, superscripts, "…").
3. **punctuation standardisation**, the Moses/NLTK convention used when
   Megatron-era corpora (OpenWebText, Wikipedia) were prepared: curly and
   low-9 quotes, primes, guillemets and TeX/Treebank quote pairs (```` `` ````
   and ``''``) become ASCII ``"`` and ``'``; hyphen-like dashes (U+2010-2013,
   U+2212) become ``-``; em dashes and horizontal bars (U+2014, U+2015) become
   `` - `` (spaced, as Moses' normalize-punctuation does); "…" becomes "...".
4. **whitespace**: CR/CRLF become LF; zero-width characters and the BOM are
   removed; tabs and Unicode spaces (no-break, thin, ideographic, ...) become
   a plain space; runs of spaces between words collapse to one (indentation
   at the start of a line is kept); spaces at line ends go; three or more
   newlines become a paragraph break (two); the text is stripped.
   Newlines themselves are kept: paragraphs matter to sentence splitting and
   to the model.

Then the document **filters**, on the cleaned text: empty, minimum/maximum
characters, minimum/maximum whitespace-separated words, and optional
de-duplication (`mg.corpus_prep.dedup`). A rejected document comes back with
the reason, one of `REASONS`, so callers can count drops per reason.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import ftfy

from mg.corpus_prep.dedup import (
    EXACT_DUPLICATE,
    NEAR_DUPLICATE,
    Deduplicator,
    build_deduplicator,
)

Normalization = Literal["NFC", "NFKC", "none"]
DedupMode = Literal["none", "exact", "near"]

# Why a document was dropped. Summaries list counts under these names.
EMPTY = "empty"
TOO_FEW_CHARS = "too_few_chars"
TOO_MANY_CHARS = "too_many_chars"
TOO_FEW_WORDS = "too_few_words"
TOO_MANY_WORDS = "too_many_words"
REASONS = (
    EMPTY,
    TOO_FEW_CHARS,
    TOO_MANY_CHARS,
    TOO_FEW_WORDS,
    TOO_MANY_WORDS,
    EXACT_DUPLICATE,
    NEAR_DUPLICATE,
)

# Names of the rewriting rules, for the "documents changed by each rule" counts.
RULES = ("repair", "unicode", "punctuation", "whitespace")

# ftfy repairs encoding damage only; normalisation and quotes are our rules 2-3.
_FTFY_CONFIG = ftfy.TextFixerConfig(
    uncurl_quotes=False,
    fix_character_width=False,
    fix_latin_ligatures=False,
    normalization=None,
    explain=False,
)

_PUNCTUATION = str.maketrans(
    {
        # double quotes: curly, low-9, reversed, double prime, guillemets
        "\u201c": '"',
        "\u201d": '"',
        "\u201e": '"',
        "\u201f": '"',
        "\u2033": '"',
        "\u00ab": '"',
        "\u00bb": '"',
        # single quotes: curly, low-9, reversed, prime, acute accent
        "\u2018": "'",
        "\u2019": "'",
        "\u201a": "'",
        "\u201b": "'",
        "\u2032": "'",
        "\u00b4": "'",
        # hyphens and short dashes
        "\u2010": "-",
        "\u2011": "-",
        "\u2012": "-",
        "\u2013": "-",
        "\u2212": "-",
        # long dashes, spaced as Moses does (the whitespace rule collapses doubles)
        "\u2014": " - ",
        "\u2015": " - ",
        # ellipsis
        "\u2026": "...",
    }
)
_TREEBANK_QUOTES = re.compile(r"``|''")

_ZERO_WIDTH = str.maketrans({"\u200b": None, "\u200c": None, "\u200d": None, "\ufeff": None})
# Tab, vertical tab, form feed and the Unicode space separators except the plain space.
_SPACES = re.compile(r"[\t\x0b\x0c\u00a0\u1680\u2000-\u200a\u202f\u205f\u3000]")
_SPACE_RUNS = re.compile(r"(?<=[^\s]) {2,}")  # after a word: not indentation
_LINE_END_SPACES = re.compile(r" +\n")
_PARAGRAPH_RUNS = re.compile(r"\n{3,}")


def repair(text: str) -> str:
    """Undo encoding damage (mojibake, HTML entities, control codes) with ftfy."""
    return ftfy.fix_text(text, _FTFY_CONFIG)


def normalize_unicode(text: str, form: Normalization) -> str:
    """NFC or NFKC normal form; ``"none"`` leaves the text as it is."""
    return text if form == "none" else unicodedata.normalize(form, text)


def standardize_punctuation(text: str) -> str:
    """ASCII quotes, dashes and ellipses (see the module docstring for the table)."""
    return _TREEBANK_QUOTES.sub('"', text.translate(_PUNCTUATION))


def normalize_whitespace(text: str) -> str:
    """One space between words, LF line ends, at most one blank line, no outer whitespace.

    Leading indentation is kept, so that verse and code keep their shape.
    """
    text = text.replace("\r\n", "\n").replace("\r", "\n").translate(_ZERO_WIDTH)
    text = _SPACE_RUNS.sub(" ", _SPACES.sub(" ", text))
    text = _LINE_END_SPACES.sub("\n", text)
    return _PARAGRAPH_RUNS.sub("\n\n", text).strip()


@dataclass(frozen=True)
class CleanOptions:
    """What a `Cleaner` does. Defaults: repair, NFC, punctuation, whitespace, no filters."""

    repair: bool = True
    normalization: Normalization = "NFC"
    punctuation: bool = True
    whitespace: bool = True
    min_chars: int = 0
    max_chars: int | None = None
    min_words: int = 0
    max_words: int | None = None
    dedup: DedupMode = "none"
    minhash_threshold: float = 0.8
    num_perm: int = 128
    shingle_size: int = 5
    seed: int = 1234

    def __post_init__(self) -> None:
        if self.normalization not in ("NFC", "NFKC", "none"):
            raise ValueError(f"normalization must be NFC, NFKC or none, not {self.normalization!r}")
        if self.dedup not in ("none", "exact", "near"):
            raise ValueError(f"dedup must be none, exact or near, not {self.dedup!r}")
        for low, high, what in (
            (self.min_chars, self.max_chars, "chars"),
            (self.min_words, self.max_words, "words"),
        ):
            if low < 0 or (high is not None and high < low):
                raise ValueError(f"need 0 <= min-{what} <= max-{what}, got {low} and {high}")


class Cleaned(NamedTuple):
    """The outcome for one document: cleaned texts, or None and why it was dropped."""

    texts: list[str] | None
    reason: str | None
    changed_by: tuple[str, ...] = ()


class Cleaner:
    """Applies `CleanOptions` to documents, one at a time, in input order.

    Stateless except for the de-duplicator, which remembers every document it
    kept (a 16-byte digest each for exact de-duplication; see `mg.corpus_prep.dedup`).
    """

    def __init__(self, options: CleanOptions | None = None) -> None:
        self.options = options or CleanOptions()
        self.deduplicator: Deduplicator | None = build_deduplicator(
            self.options.dedup,
            threshold=self.options.minhash_threshold,
            num_perm=self.options.num_perm,
            shingle_size=self.options.shingle_size,
            seed=self.options.seed,
        )

    def rewrite(self, text: str) -> tuple[str, tuple[str, ...]]:
        """The text after the rewriting rules, and the names of the rules that changed it."""
        options, changed = self.options, []
        steps = (
            ("repair", options.repair, repair),
            ("unicode", True, lambda t: normalize_unicode(t, options.normalization)),
            ("punctuation", options.punctuation, standardize_punctuation),
            ("whitespace", options.whitespace, normalize_whitespace),
        )
        for name, enabled, step in steps:
            if enabled:
                new = step(text)
                if new != text:
                    changed.append(name)
                text = new
        return text, tuple(changed)

    def rejection(self, text: str) -> str | None:
        """The length filter a cleaned text fails, or None."""
        options = self.options
        if not text.strip():
            return EMPTY
        chars = len(text)
        if chars < options.min_chars:
            return TOO_FEW_CHARS
        if options.max_chars is not None and chars > options.max_chars:
            return TOO_MANY_CHARS
        if options.min_words or options.max_words is not None:
            words = len(text.split())
            if words < options.min_words:
                return TOO_FEW_WORDS
            if options.max_words is not None and words > options.max_words:
                return TOO_MANY_WORDS
        return None

    def clean_fields(self, texts: Sequence[str]) -> Cleaned:
        """Clean the texts of one document (one per json key).

        Every text is rewritten and must pass the length filters; the
        document is dropped with the first failing text's reason. Duplicates
        are judged on all the texts together, and only kept documents are
        remembered, so the first copy of a duplicate is the one kept.
        """
        cleaned, changed = [], set()
        for text in texts:
            new, rules = self.rewrite(text)
            changed.update(rules)
            reason = self.rejection(new)
            if reason is not None:
                return Cleaned(None, reason, tuple(r for r in RULES if r in changed))
            cleaned.append(new)
        changed_by = tuple(r for r in RULES if r in changed)
        if self.deduplicator is not None:
            reason = self.deduplicator.check_and_add("\n\x00\n".join(cleaned))
            if reason is not None:
                return Cleaned(None, reason, changed_by)
        return Cleaned(cleaned, None, changed_by)

    def clean(self, text: str) -> tuple[str | None, str | None]:
        """``(cleaned text, None)`` for a kept document, ``(None, reason)`` for a dropped one."""
        result = self.clean_fields([text])
        return (result.texts[0], None) if result.texts is not None else (None, result.reason)
