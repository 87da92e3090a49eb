"""Punkt's language rules, pinned here so that `--split-sentences` does not drift with nltk.

NLTK's Punkt splitter has two halves. The model (abbreviations, collocations,
sentence starters, orthographic context: the punkt_tab data) is a file and
does not change. The language rules (`PunktLanguageVars`: which characters end
a sentence, which may not appear inside a word, which closing punctuation is
moved onto the sentence before) are code, and nltk 3.10 changed them: it
counts the curly quotes ‘ ’ “ ” and the guillemets « » as closing punctuation
like " and ', so `at stake. ” in a joint letter` splits after the ” instead of
before it, and `“Really!” he cried.` becomes two sentences. Megatron-LM
core_v0.16.1 locks nltk 3.9.3, whose rules do not.

`language_vars(rules, keep_newlines)` builds the rules of the release named,
whatever nltk is installed:

- ``nltk-3.9`` (default): nltk 3.9.3's rules, as Megatron core_v0.16.1 splits;
- ``nltk-3.10``: nltk 3.10's, curly quotes and guillemets closing sentences.

Every regular expression the splitter takes from its language rules is
restated and compiled here with the standard `re` module (nltk 3.10 compiles
them with `regex` under a wall-clock timeout, which would make a very long
document's split depend on the machine's speed). `keep_newlines` swaps in
Megatron's `CustomLanguageVars` context (the whitespace after a sentence,
newlines included, stays in it).
"""

from __future__ import annotations

import functools
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # importing nltk takes seconds: only when splitting
    # lazy: nltk takes seconds to import; only sentence splitting needs it
    from nltk.tokenize.punkt import PunktLanguageVars

PUNKT_RULES = ("nltk-3.9", "nltk-3.10")
DEFAULT_PUNKT_RULES = "nltk-3.9"  # Megatron-LM core_v0.16.1's lock: nltk 3.9.3

# What nltk 3.10 added to the closing punctuation: ‘ ’ “ ” « »
CURLY_QUOTES = "\u2018\u2019\u201c\u201d\xab\xbb"

SENT_END_CHARS = (".", "?", "!")
INTERNAL_PUNCTUATION = ",:;"
WORD_START = r"[^\(\"\`{\[:;&\#\*@\)}\]\-,]"
MULTI_CHAR_PUNCT = r"(?:\-{2,}|\.{2,}|(?:\.\s){2,}\.)"

WORD_TOKENIZE_FMT = r"""(
        %(MultiChar)s
        |
        (?=%(WordStart)s)\S+?  # Accept word characters until end is found
        (?= # Sequences marking a word's end
            \s|                                 # White-space
            $|                                  # End-of-string
            %(NonWord)s|%(MultiChar)s|          # Punctuation
            ,(?=$|\s|%(NonWord)s|%(MultiChar)s) # Comma if at end of word
        )
        |
        \S
    )"""

# A candidate sentence end and the token after it (Punkt's stock context).
PERIOD_CONTEXT_FMT = r"""
        %(SentEndChars)s             # a potential sentence ending
        (?=(?P<after_tok>
            %(NonWord)s              # either other punctuation
            |
            \s+(?P<next_tok>\S+)     # or whitespace and some other token
        ))"""

# Megatron's CustomLanguageVars (--keep-newlines): `\s*` after the sentence end
# and the next token as `\S+`, so the whitespace stays with the sentence before.
KEEP_NEWLINES_PERIOD_CONTEXT_FMT = r"""
        \S*                          # some word material
        %(SentEndChars)s             # a potential sentence ending
        \s*                          # the whitespace, newlines included, stays
        (?=(?P<after_tok>
            %(NonWord)s              # either other punctuation
            |
            (?P<next_tok>\S+)        # the next token
        ))"""


def closing_quotes(rules: str) -> str:
    """The characters besides ASCII punctuation that close a sentence under `rules`."""
    if rules not in PUNKT_RULES:
        raise ValueError(f"unknown punkt rules {rules!r}; expected one of {PUNKT_RULES}")
    return CURLY_QUOTES if rules == "nltk-3.10" else ""


def language_vars(
    rules: str = DEFAULT_PUNKT_RULES, keep_newlines: bool = False
) -> PunktLanguageVars:
    """A `PunktLanguageVars` with the rules of nltk release `rules` (see the module docstring)."""
    return _language_vars_class(rules, keep_newlines)()


@functools.cache
def _language_vars_class(rules: str, keep_newlines: bool) -> type[PunktLanguageVars]:
    # lazy: nltk takes seconds to import; only sentence splitting needs it
    from nltk.tokenize.punkt import PunktLanguageVars

    quotes = closing_quotes(rules)
    # Inside a character class the order of the characters does not matter;
    # sorted so the pattern text does not depend on set order.
    other_ends = re.escape("".join(sorted(set(SENT_END_CHARS) - {"."})))
    non_word = r"(?:[)\";}\]\*:@\'\({\[" + quotes + other_ends + "])"
    sent_end = "[" + re.escape("".join(SENT_END_CHARS)) + "]"
    word_tokenizer = re.compile(
        WORD_TOKENIZE_FMT
        % {"NonWord": non_word, "MultiChar": MULTI_CHAR_PUNCT, "WordStart": WORD_START},
        re.UNICODE | re.VERBOSE,
    )
    context_fmt = KEEP_NEWLINES_PERIOD_CONTEXT_FMT if keep_newlines else PERIOD_CONTEXT_FMT
    period_context = re.compile(
        context_fmt % {"NonWord": non_word, "SentEndChars": sent_end}, re.UNICODE | re.VERBOSE
    )

    class PinnedLanguageVars(PunktLanguageVars):
        """Punkt's language rules as nltk `rules` had them, compiled with `re`."""

        sent_end_chars = SENT_END_CHARS
        internal_punctuation = INTERNAL_PUNCTUATION
        re_boundary_realignment = re.compile(
            r"[\"\')\]}" + quotes + r"]+?(?:\s+|(?=--)|$)", re.MULTILINE
        )
        _re_word_start = WORD_START
        _re_multi_char_punct = MULTI_CHAR_PUNCT
        _word_tokenize_fmt = WORD_TOKENIZE_FMT
        _period_context_fmt = context_fmt

        @property
        def _re_sent_end_chars(self) -> str:
            return sent_end

        @property
        def _re_non_word_chars(self) -> str:
            return non_word

        def _word_tokenizer_re(self) -> re.Pattern[str]:
            return word_tokenizer

        def word_tokenize(self, s: str) -> list[str]:
            return word_tokenizer.findall(s)

        def period_context_re(self) -> re.Pattern[str]:
            return period_context

    PinnedLanguageVars.__name__ = f"PunktLanguageVars_{rules.replace('-', '_').replace('.', '_')}"
    return PinnedLanguageVars
