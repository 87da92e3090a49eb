"""Sentence splitting for `--split-sentences`, as Megatron's preprocess_data.py does it.

Megatron splits with NLTK punkt: the stock English model, and with
`--keep-newlines` a `PunktSentenceTokenizer` built from the same parameters
with its `CustomLanguageVars` (which keeps the whitespace, newlines included,
at the end of each sentence). Punkt's language rules come from
`punkt_rules` (`--punkt-rules`), not from the installed nltk, so the split
does not change with nltk's version. It cuts the text into pieces of 1,000,000
characters first and splits each piece on its own; we do the same, so that
long documents split the same way.

The choice of model is made once, in the main process (`resolve_splitter`),
and handed to the workers as a small picklable `SplitterSpec`:

1. punkt_tab data for `--lang` found by NLTK (`NLTK_DATA`, ~/nltk_data, ...);
2. for English, the punkt_tab data shipped as our fixture, written once into
   a cache NLTK data folder (never `nltk.download`, which hangs offline);
3. else a Punkt model trained on the first megabytes of the corpus itself,
   with a warning, since its boundaries differ from the stock model's.

`--sentence-splitter spacy:<pipeline>` uses a spaCy pipeline instead, or
`spacy.blank(lang)` + `sentencizer` when that pipeline is not installed.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from mg.core.tokenizers.punkt import install_punkt_tab
from mg.corpus_prep.punkt_rules import DEFAULT_PUNKT_RULES, language_vars

if TYPE_CHECKING:  # importing nltk takes seconds (it pulls in scipy): only when splitting
    from nltk.tokenize.punkt import PunktParameters

# Megatron's piece size: text is split in pieces of this many characters.
MEGATRON_SPLIT_PIECE = 1_000_000
# How much corpus text trains a Punkt model when no model is installed.
PUNKT_TRAINING_CHARS = 8_000_000

# NLTK punkt language names -> ISO codes, for spacy.blank().
SPACY_LANGUAGE_CODES = {
    "czech": "cs",
    "danish": "da",
    "dutch": "nl",
    "english": "en",
    "estonian": "et",
    "finnish": "fi",
    "french": "fr",
    "german": "de",
    "greek": "el",
    "italian": "it",
    "malayalam": "ml",
    "norwegian": "nb",
    "polish": "pl",
    "portuguese": "pt",
    "russian": "ru",
    "slovene": "sl",
    "spanish": "es",
    "swedish": "sv",
    "turkish": "tr",
}


class SplitterError(Exception):
    """The requested splitter cannot be set up (bad language, spaCy missing, ...)."""


class SentenceSplitter(Protocol):
    def split(self, text: str) -> list[str]: ...


@dataclass(frozen=True)
class SplitterSpec:
    """What the workers build: `kind` is "none", "nltk" or "spacy".

    nltk: `punkt_dir` (a punkt_tab language folder) or `punkt_params` (trained),
    and `punkt_rules` (the nltk release whose language rules to apply).
    spacy: `spacy_pipeline` to load, or None for `spacy.blank(spacy_lang)`.
    """

    kind: str = "none"
    keep_newlines: bool = False
    punkt_dir: str | None = None
    punkt_params: PunktParameters | None = None
    punkt_rules: str = DEFAULT_PUNKT_RULES
    spacy_pipeline: str | None = None
    spacy_lang: str = "en"


def megatron_pieces(text: str) -> list[str]:
    """Megatron's cut of a text into pieces of at most 1,000,000 characters."""
    return [text[i : i + MEGATRON_SPLIT_PIECE] for i in range(0, len(text), MEGATRON_SPLIT_PIECE)]


class NoSplitter:
    """Without --split-sentences a document is one sequence."""

    def split(self, text: str) -> list[str]:
        return [text]


class PunktSplitter:
    """NLTK punkt with Megatron's setup (see the module docstring)."""

    def __init__(
        self, params: PunktParameters, keep_newlines: bool, rules: str = DEFAULT_PUNKT_RULES
    ) -> None:
        # lazy: nltk takes seconds to import; only sentence splitting needs it
        from nltk.tokenize.punkt import PunktSentenceTokenizer

        lang_vars = language_vars(rules, keep_newlines)
        self._tokenizer = PunktSentenceTokenizer(params, lang_vars=lang_vars)

    def split(self, text: str) -> list[str]:
        return [s for piece in megatron_pieces(text) for s in self._tokenizer.tokenize(piece)]


class SpacySplitter:
    """A spaCy pipeline's sentences; with --keep-newlines the trailing whitespace stays."""

    def __init__(self, pipeline: str | None, lang: str, keep_newlines: bool) -> None:
        import spacy  # lazy: spaCy is optional (mg-corpus-prep[spacy])

        if pipeline is None:
            self._nlp = spacy.blank(lang)
        else:
            self._nlp = spacy.load(pipeline, exclude=["ner", "lemmatizer"])
        if not {"parser", "senter", "sentencizer"} & set(self._nlp.pipe_names):
            self._nlp.add_pipe("sentencizer")
        self._keep_newlines = keep_newlines

    def split(self, text: str) -> list[str]:
        sentences: list[str] = []
        for doc in self._nlp.pipe(megatron_pieces(text)):
            for sent in doc.sents:
                if not self._keep_newlines:
                    if sent.text.strip():
                        sentences.append(sent.text.strip())
                    continue
                # spaCy starts a sentence with the whitespace before it; punkt with
                # --keep-newlines ends the previous one with it. Do as punkt does.
                piece = sent.text_with_ws
                body = piece.lstrip()
                if sentences and len(body) < len(piece):
                    sentences[-1] += piece[: len(piece) - len(body)]
                    piece = body
                if piece:
                    sentences.append(piece)
        return sentences


def build_splitter(spec: SplitterSpec) -> SentenceSplitter:
    """Build the splitter a worker uses; cheap for NLTK, a model load for spaCy."""
    if spec.kind == "none":
        return NoSplitter()
    if spec.kind == "nltk":
        params = spec.punkt_params
        if params is None:
            assert spec.punkt_dir is not None
            params = load_punkt_tab(spec.punkt_dir)
        return PunktSplitter(params, spec.keep_newlines, spec.punkt_rules)
    if spec.kind == "spacy":
        return SpacySplitter(spec.spacy_pipeline, spec.spacy_lang, spec.keep_newlines)
    raise ValueError(f"unknown splitter kind {spec.kind!r}")


# --- finding punkt data ----------------------------------------------------------------------


def load_punkt_tab(lang_dir: str) -> PunktParameters:
    """Punkt parameters from a `punkt_tab/<lang>/` folder, decoded as NLTK's loader does.

    Read directly rather than through `nltk.tokenize.punkt.load_punkt_params`,
    whose path sandbox refuses folders outside NLTK's data path (our cache).
    """
    # lazy: nltk takes seconds to import; only sentence splitting needs it
    from nltk.tabdata import PunktDecoder
    from nltk.tokenize.punkt import PunktParameters

    decoder = PunktDecoder()
    folder = Path(lang_dir)
    params = PunktParameters()
    try:
        with open(folder / "collocations.tab", encoding="utf-8") as f:
            params.collocations = set(decoder.tab2tups(f))
        with open(folder / "sent_starters.txt", encoding="utf-8") as f:
            params.sent_starters = decoder.txt2set(f)
        with open(folder / "abbrev_types.txt", encoding="utf-8") as f:
            params.abbrev_types = decoder.txt2set(f)
        with open(folder / "ortho_context.tab", encoding="utf-8") as f:
            params.ortho_context = decoder.tab2intdict(f)
    except OSError as err:
        raise SplitterError(
            f"{lang_dir}: incomplete punkt_tab model ({err.strerror}: {err.filename}); "
            "reinstall it or remove the folder"
        ) from err
    return params


def find_installed_punkt(lang: str) -> str | None:
    """The punkt_tab folder NLTK finds for `lang` on its data path, or None.

    Only looks on disk (`nltk.data.find`): no download is ever attempted.
    """
    import nltk.data  # lazy: nltk takes seconds to import; only sentence splitting needs it

    try:
        pointer = nltk.data.find(f"tokenizers/punkt_tab/{lang}/")
    except LookupError:
        return None
    path = getattr(pointer, "path", None)
    return str(path) if path and os.path.isdir(path) else None


def punkt_cache_dir() -> Path:
    """Where the fixture's punkt_tab data is installed: $MG_NLTK_DATA or ~/.cache/mg/nltk_data."""
    root = os.environ.get("MG_NLTK_DATA")
    return Path(root) if root else Path.home() / ".cache" / "mg" / "nltk_data"


def install_fixture_punkt(nltk_data: Path) -> Path:
    """Write our English punkt_tab fixture under `nltk_data`; return the language folder."""
    return install_punkt_tab(nltk_data)


def train_punkt(text: str) -> PunktParameters:
    """A Punkt model trained on `text` (NLTK's unsupervised trainer)."""
    # lazy: nltk takes seconds to import; only sentence splitting needs it
    from nltk.tokenize.punkt import PunktTrainer

    trainer = PunktTrainer()
    trainer.train(text, finalize=True)
    return trainer.get_params()


def resolve_splitter(
    choice: str,
    lang: str,
    keep_newlines: bool,
    corpus_sample: Callable[[int], str],
    warn: Callable[[str], None],
    punkt_rules: str = DEFAULT_PUNKT_RULES,
) -> SplitterSpec:
    """Decide, once, which splitter the workers use for `--sentence-splitter choice`.

    `corpus_sample(n)` returns up to n characters of corpus text; it is only
    called when a Punkt model has to be trained. `warn` reports fallbacks.
    """
    if choice == "nltk":
        spec = _resolve_punkt(lang, keep_newlines, corpus_sample, warn)
        return replace(spec, punkt_rules=punkt_rules)
    if choice.startswith("spacy"):
        _, _, pipeline = choice.partition(":")
        return _resolve_spacy(pipeline or None, lang, keep_newlines, warn)
    raise SplitterError(
        f"--sentence-splitter {choice!r}: expected 'nltk' or 'spacy:<pipeline>' "
        "(e.g. spacy:en_core_web_sm)"
    )


def _resolve_punkt(
    lang: str,
    keep_newlines: bool,
    corpus_sample: Callable[[int], str],
    warn: Callable[[str], None],
) -> SplitterSpec:
    if not lang or not all(c.isalnum() or c in "-_" for c in lang):
        raise SplitterError(f"--lang {lang!r} is not a language name (e.g. english, german)")
    found = find_installed_punkt(lang)
    if found is None:
        cached = punkt_cache_dir() / "tokenizers" / "punkt_tab" / lang
        if cached.is_dir():
            found = str(cached)
        elif lang == "english":
            try:
                found = str(install_fixture_punkt(punkt_cache_dir()))
            except Exception as err:  # fixture fetch failed (offline, ...): train instead
                warn(f"could not install the punkt_tab English fixture ({err})")
    if found is not None:
        return SplitterSpec("nltk", keep_newlines, punkt_dir=found)
    sample = corpus_sample(PUNKT_TRAINING_CHARS)
    warn(
        f"no NLTK punkt_tab model for --lang {lang} (looked on NLTK's data path and in "
        f"{punkt_cache_dir()}); trained a Punkt model on the first {len(sample):,} characters "
        "of the corpus instead. Sentence boundaries will differ from Megatron's; install "
        f"punkt_tab/{lang} under $NLTK_DATA/tokenizers/ for the stock model."
    )
    return SplitterSpec("nltk", keep_newlines, punkt_params=train_punkt(sample))


def _resolve_spacy(
    pipeline: str | None, lang: str, keep_newlines: bool, warn: Callable[[str], None]
) -> SplitterSpec:
    try:
        # lazy: spaCy is optional (mg-corpus-prep[spacy])
        import spacy
        import spacy.util
    except ImportError:
        raise SplitterError(
            "--sentence-splitter spacy needs spaCy: install mg-corpus-prep[spacy] "
            "(pip install spacy), or use --sentence-splitter nltk"
        ) from None
    code = SPACY_LANGUAGE_CODES.get(lang, lang)
    if pipeline:
        head = pipeline.split("_", 1)[0]
        if _spacy_has_language(head):
            code = head
    if not _spacy_has_language(code):
        raise SplitterError(
            f"spaCy has no language {code!r} (from --lang {lang}); pass an ISO code "
            "such as en or de as --lang"
        )
    if pipeline and pipeline != code:
        if spacy.util.is_package(pipeline) or Path(pipeline).is_dir():
            return SplitterSpec("spacy", keep_newlines, spacy_pipeline=pipeline, spacy_lang=code)
        warn(
            f"spaCy pipeline {pipeline!r} is not installed; splitting with "
            f"spacy.blank({code!r}) + the rule-based 'sentencizer' instead"
        )
    return SplitterSpec("spacy", keep_newlines, spacy_lang=code)


def _spacy_has_language(code: str) -> bool:
    import spacy.util  # lazy: spaCy is optional (mg-corpus-prep[spacy])

    try:
        spacy.util.get_lang_class(code)
    except Exception:
        return False
    return True
