"""--split-sentences does not drift with nltk: punkt's language rules are pinned (`--punkt-rules`).

The expected splits below were produced by the stock nltk releases themselves:
`nltk-3.9` by nltk 3.9.3 (Megatron-LM core_v0.16.1's lock; `PunktTokenizer("english")`
and, for --keep-newlines, Megatron's `CustomLanguageVars`), `nltk-3.10` by nltk
3.10.4, both with the punkt_tab English model. Our splitter must give them
whatever nltk is installed.
"""

from __future__ import annotations

import json
import re

import pytest

from mg.corpus_prep.cli import main
from mg.corpus_prep.punkt_rules import PUNKT_RULES, language_vars
from mg.corpus_prep.splitter import build_splitter, resolve_splitter
from mg.indexed_dataset.format import IndexedDataset

STAKE = (
    "The ministers warned that the future of the union was at stake. ” in a joint letter, "
    "they asked for talks."
)

# text -> (nltk 3.9.3's sentences, nltk 3.10.4's sentences)
CASES = {
    STAKE: (
        [
            "The ministers warned that the future of the union was at stake.",
            "” in a joint letter, they asked for talks.",
        ],
        [
            "The ministers warned that the future of the union was at stake. ”",
            "in a joint letter, they asked for talks.",
        ],
    ),
    "“We believe the future of the alliance is at stake.” In a joint letter, the ministers "
    "asked for talks.": (
        [
            "“We believe the future of the alliance is at stake.” In a joint letter, the "
            "ministers asked for talks."
        ],
        [
            "“We believe the future of the alliance is at stake.”",
            "In a joint letter, the ministers asked for talks.",
        ],
    ),
    # nested quotes
    "He said, “She told me ‘it is over.’ ” Then he left.": (
        ["He said, “She told me ‘it is over.’ ” Then he left."],
        ["He said, “She told me ‘it is over.’", "” Then he left."],
    ),
    "Did she say “yes?” I think so! “Really!” he cried.": (
        ["Did she say “yes?” I think so!", "“Really!” he cried."],
        ["Did she say “yes?”", "I think so!", "“Really!”", "he cried."],
    ),
    "Wait... what? “Hmm...” she said. «Non.» Il est parti.": (
        ["Wait... what?", "“Hmm...” she said.", "«Non.» Il est parti."],
        ["Wait... what?", "“Hmm...” she said.", "«Non.»", "Il est parti."],
    ),
    "The students’ union voted. ‘Fine.’ They agreed. ‘Done.’": (
        ["The students’ union voted.", "‘Fine.’ They agreed.", "‘Done.’"],
        ["The students’ union voted.", "‘Fine.’", "They agreed.", "‘Done.’"],
    ),
    "She wrote: “It works.”— and then “It fails.” Nobody knew why.": (
        ["She wrote: “It works.”— and then “It fails.” Nobody knew why."],
        ["She wrote: “It works.", "”— and then “It fails.”", "Nobody knew why."],
    ),
    # ASCII quotes, brackets and abbreviations: the same under both
    'He said "stop." Then he left.': (
        ['He said "stop."', "Then he left."],
        ['He said "stop."', "Then he left."],
    ),
    "(This is a test.) And another one (with nested [brackets.]) Final sentence!": (
        ["(This is a test.)", "And another one (with nested [brackets.])", "Final sentence!"],
        ["(This is a test.)", "And another one (with nested [brackets.])", "Final sentence!"],
    ),
    "Dr. Smith met Mr. Jones at 5 p.m. on Jan. 3. They talked.": (
        ["Dr. Smith met Mr. Jones at 5 p.m. on Jan. 3.", "They talked."],
        ["Dr. Smith met Mr. Jones at 5 p.m. on Jan. 3.", "They talked."],
    ),
}

# --keep-newlines (Megatron's CustomLanguageVars): text -> (3.9.3, 3.10.4)
KEEP_NEWLINES_CASES = {
    STAKE: (
        [
            "The ministers warned that the future of the union was at stake. ",
            "” in a joint letter, they asked for talks.",
        ],
        [
            "The ministers warned that the future of the union was at stake. ”",
            "in a joint letter, they asked for talks.",
        ],
    ),
    "“First.”\nSecond line.\n\n“Third.” Fourth.\n": (
        ["“First.”\nSecond line.\n\n", "“Third.” Fourth."],
        ["“First.”", "Second line.\n\n", "“Third.”", "Fourth."],
    ),
    "Did she say “yes?” I think so! “Really!” he cried.": (
        ["Did she say “yes?” I think so! ", "“Really!” he cried."],
        ["Did she say “yes?”", "I think so! ", "“Really!”", "he cried."],
    ),
}


def splitter(rules: str, keep_newlines: bool):
    spec = resolve_splitter("nltk", "english", keep_newlines, lambda n: "", print, rules)
    assert spec.punkt_rules == rules
    return build_splitter(spec)


@pytest.mark.parametrize("keep_newlines", [False, True])
@pytest.mark.parametrize("rules", PUNKT_RULES)
def test_splits_are_those_of_the_nltk_release_named(rules, keep_newlines):
    split = splitter(rules, keep_newlines).split
    which = PUNKT_RULES.index(rules)
    cases = KEEP_NEWLINES_CASES if keep_newlines else CASES
    for text, expected in cases.items():
        assert split(text) == expected[which], text


def test_the_rules_are_compiled_here_with_re():
    """No pattern comes from the installed nltk (3.10 compiles with `regex` under a timeout)."""
    for rules in PUNKT_RULES:
        for keep_newlines in (False, True):
            lang_vars = language_vars(rules, keep_newlines)
            for pattern in (
                lang_vars.period_context_re(),
                lang_vars._word_tokenizer_re(),
                lang_vars.re_boundary_realignment,
            ):
                assert isinstance(pattern, re.Pattern)


def test_mg_prep_splits_like_megatron_by_default_and_punkt_rules_selects(tmp_path):
    from mg.core.fixtures import fixture_dir

    corpus = tmp_path / "c.jsonl"
    text = "Did she say \u201cyes?\u201d I think so! \u201cReally!\u201d"
    corpus.write_text(json.dumps({"text": text}) + "\n")
    vocab = fixture_dir("minilm-bert") / "vocab.txt"
    sentences = {}
    for rules in ("default", "nltk-3.10"):
        line = ["--input", corpus, "--output-prefix", tmp_path / rules, "--workers", "0"]
        line += ["--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", vocab]
        line += ["--split-sentences", "--no-progress-bar"]
        if rules != "default":
            line += ["--punkt-rules", rules]
        with pytest.raises(SystemExit) as exit_:
            main([str(part) for part in line])
        assert exit_.value.code == 0
        sentences[rules] = len(IndexedDataset(str(tmp_path / f"{rules}_text_sentence")))
    assert sentences == {"default": 2, "nltk-3.10": 3}
