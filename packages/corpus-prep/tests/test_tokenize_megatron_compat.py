"""Byte-identity of `mg-prep tokenize` with Megatron-LM's tools/preprocess_data.py.

Megatron-LM's script cannot be run here (it is not on PyPI and imports
`megatron.training`), so the reference is an independent, minimal
re-statement of what it does (core_v0.15, `Encoder.split` + `Encoder.encode`
+ `Partition.process_json_file`), written from Megatron's source and sharing
no code with `mg.corpus_prep`:

- lines read from the file opened in text mode, `json.loads(line)[key]`;
- with --split-sentences: Megatron's split pass (punkt on pieces of 1,000,000
  characters, `json.dumps` of the sentence lists, read back by the encode
  pass); NLTK's own `PunktTokenizer("english")` (punkt_tab, NLTK >= 3.9's
  replacement of the `nltk.load("tokenizers/punkt/english.pickle")` that
  Megatron calls) with nltk 3.9.3's language rules (Megatron core_v0.16.1's
  lock; the two rules nltk 3.10 changed are restated here), and with
  --keep-newlines a `PunktSentenceTokenizer` built on its parameters with
  Megatron's `CustomLanguageVars`, copied here;
- tokenizers as Megatron's classic (--legacy-tokenizer) ones behave:
  GPT-2 = a re-statement of OpenAI's encoder.py that Megatron's
  gpt2_tokenization.py is (regex + byte-level BPE, no special tokens),
  BERT = transformers' pure-Python `BasicTokenizer` + `WordpieceTokenizer`
  (Google's FullTokenizer, with Megatron's 200-character word limit), ids
  from vocab.txt with [BOS]/[EOS] appended as Megatron does;
- megatron-core's own `IndexedDatasetBuilder.add_document` / `finalize` and
  `DType.optimal_dtype` write the files.

The corpus is real text (Shakespeare, Botchan, Wikipedia markup) plus edge
cases (empty and whitespace-only documents, a literal <|endoftext|>, control
characters, long words, a document longer than Megatron's 1,000,000-character
split piece).
"""

from __future__ import annotations

import json
import os
import unicodedata
from pathlib import Path

import pytest
import regex

from mg.core.fixtures import fixture_dir, fixture_path
from mg.corpus_prep.cli import main
from mg.corpus_prep.sample_corpus import botchan_documents, real_corpus, write_jsonl

pytestmark = pytest.mark.compat


# --- the reference ---------------------------------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1))
    bs += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


class OpenAIGPT2:
    """OpenAI's GPT-2 encoder.py, which Megatron's legacy GPT2BPETokenizer runs."""

    PATTERN = regex.compile(
        r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    )

    def __init__(self, vocab_file: Path, merge_file: Path) -> None:
        self.encoder = json.loads(vocab_file.read_text(encoding="utf-8"))
        merges = merge_file.read_text(encoding="utf-8").split("\n")[1:-1]
        self.ranks = {tuple(m.split()): i for i, m in enumerate(merges)}
        self.byte_encoder = _bytes_to_unicode()
        self.cache: dict[str, list[str]] = {}
        self.vocab_size = len(self.encoder)
        self.eod = self.encoder["<|endoftext|>"]

    def bpe(self, token: str) -> list[str]:
        if token in self.cache:
            return self.cache[token]
        word = list(token)
        while len(word) > 1:
            pairs = {(word[i], word[i + 1]) for i in range(len(word) - 1)}
            best = min(pairs, key=lambda p: self.ranks.get(p, float("inf")))
            if best not in self.ranks:
                break
            merged, i = [], 0
            while i < len(word):
                if i < len(word) - 1 and (word[i], word[i + 1]) == best:
                    merged.append(word[i] + word[i + 1])
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = merged
        self.cache[token] = word
        return word

    def tokenize(self, text: str) -> list[int]:
        ids = []
        for token in self.PATTERN.findall(text):
            mapped = "".join(self.byte_encoder[b] for b in token.encode("utf-8"))
            ids.extend(self.encoder[piece] for piece in self.bpe(mapped))
        return ids


class GoogleBertWordPiece:
    """Google's FullTokenizer (Megatron's bert_tokenization.py) via transformers' Python copy.

    Two differences of transformers' `BasicTokenizer` from Megatron's are
    undone or harmless: its `_clean_text` drops every C* character (private
    use, unassigned, ...) where Megatron drops only Cc and Cf, so it is
    restated here from Megatron's source; it adds an NFC normalisation, which
    with lower-casing is undone by the NFD before accents are stripped.
    """

    def __init__(self, vocab_file: Path, lower_case: bool = True) -> None:
        from transformers.models.bert.tokenization_bert_legacy import (
            BasicTokenizer,
            WordpieceTokenizer,
        )

        class MegatronBasicTokenizer(BasicTokenizer):
            def _clean_text(self, text: str) -> str:  # Megatron's _clean_text/_is_control
                out = []
                for char in text:
                    if char in "\t\n\r":
                        out.append(" ")
                    elif ord(char) in (0, 0xFFFD) or unicodedata.category(char) in ("Cc", "Cf"):
                        continue
                    elif unicodedata.category(char) == "Zs" or char == " ":
                        out.append(" ")
                    else:
                        out.append(char)
                return "".join(out)

        self.vocab: dict[str, int] = {}
        with vocab_file.open(encoding="utf-8") as f:
            for index, line in enumerate(f):
                self.vocab[line.strip()] = index  # Megatron's load_vocab
        for extra in ("[BOS]", "[EOS]"):  # Megatron's _BertWordPieceTokenizer.add_token
            self.vocab.setdefault(extra, len(self.vocab))
        self.basic = MegatronBasicTokenizer(do_lower_case=lower_case)
        self.wordpiece = WordpieceTokenizer(
            self.vocab, unk_token="[UNK]", max_input_chars_per_word=200
        )
        self.vocab_size = len(self.vocab)
        self.eod = self.vocab["[EOS]"]

    def tokenize(self, text: str) -> list[int]:
        pieces = [p for t in self.basic.tokenize(text) for p in self.wordpiece.tokenize(t)]
        return [self.vocab[p] for p in pieces]


def _nltk_393_language_vars():
    """nltk 3.9.3's PunktLanguageVars (Megatron core_v0.16.1's lock) on whatever nltk is here.

    nltk 3.10 changed two of its rules, adding the curly quotes and guillemets
    to the closing punctuation; these are 3.9.3's two, as its punkt.py has them.
    """
    import re

    from nltk.tokenize.punkt import PunktLanguageVars

    class Nltk393LanguageVars(PunktLanguageVars):
        re_boundary_realignment = re.compile(r'["\')\]}]+?(?:\s+|(?=--)|$)', re.MULTILINE)

        @property
        def _re_non_word_chars(self):
            other_ends = re.escape("".join(set(self.sent_end_chars) - {"."}))
            return r"(?:[)\";}\]\*:@\'\({\[" + other_ends + "])"

    return Nltk393LanguageVars


def _custom_language_vars():
    class CustomLanguageVars(_nltk_393_language_vars()):  # Megatron's, verbatim
        _period_context_fmt = r"""
            \S*                          # some word material
            %(SentEndChars)s             # a potential sentence ending
            \s*                       #  <-- THIS is what I changed
            (?=(?P<after_tok>
                %(NonWord)s              # either other punctuation
                |
                (?P<next_tok>\S+)     #  <-- Normally you would have \s+ here
            ))"""

    return CustomLanguageVars()


def megatron_preprocess(
    input_path: Path,
    output_prefix: str,
    tokenizer,
    json_keys: list[str],
    split_sentences: bool,
    keep_newlines: bool,
    append_eod: bool,
    nltk_data: Path,
) -> None:
    """preprocess_data.py with --partitions 1, both passes, in one process."""
    import nltk
    from megatron.core.datasets import indexed_dataset
    from nltk.tokenize.punkt import PunktSentenceTokenizer, PunktTokenizer

    if split_sentences:
        if str(nltk_data) not in nltk.data.path:
            nltk.data.path.insert(0, str(nltk_data))
        splitter = PunktTokenizer("english")
        splitter._lang_vars = _nltk_393_language_vars()()
        if keep_newlines:
            splitter = PunktSentenceTokenizer(
                train_text=splitter._params, lang_vars=_custom_language_vars()
            )

    def split(json_line: str) -> str:  # Encoder.split
        data = json.loads(json_line)
        output = {}
        for key in json_keys:
            text = data[key]
            max_len = 1000000
            tokens_list = [
                splitter.tokenize(text[i : i + max_len]) for i in range(0, len(text), max_len)
            ]
            output[key] = [tokens for partial in tokens_list for tokens in partial]
        return json.dumps(output)

    def encode(json_line: str):  # Encoder.encode
        data = json.loads(json_line)
        ids, lens = {}, {}
        for key in json_keys:
            text = data[key]
            sentences = text if isinstance(text, list) else [text]
            doc_ids, sentence_lens = [], []
            for sentence in sentences:
                sentence_ids = tokenizer.tokenize(sentence)
                if len(sentence_ids) > 0:
                    doc_ids.extend(sentence_ids)
                    sentence_lens.append(len(sentence_ids))
            if len(doc_ids) > 0 and append_eod:
                doc_ids.append(tokenizer.eod)
                sentence_lens[-1] += 1
            ids[key] = doc_ids
            lens[key] = sentence_lens
        return ids, lens

    level = "sentence" if split_sentences else "document"
    builders = {
        key: indexed_dataset.IndexedDatasetBuilder(
            f"{output_prefix}_{key}_{level}.bin",
            dtype=indexed_dataset.DType.optimal_dtype(tokenizer.vocab_size),
        )
        for key in json_keys
    }
    with open(input_path, encoding="utf-8") as fin:
        for line in fin:
            doc, lens = encode(split(line) if split_sentences else line)
            for key in doc:
                builders[key].add_document(doc[key], lens[key])
    for key in json_keys:
        builders[key].finalize(f"{output_prefix}_{key}_{level}.idx")


# --- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def nltk_data(tmp_path_factory) -> Path:
    """Our punkt_tab English fixture installed in a private NLTK data folder (MG_NLTK_DATA)."""
    from mg.corpus_prep.splitter import install_fixture_punkt

    folder = tmp_path_factory.mktemp("nltk_data")
    install_fixture_punkt(folder)
    old = os.environ.get("MG_NLTK_DATA")
    os.environ["MG_NLTK_DATA"] = str(folder)
    yield folder
    if old is None:
        os.environ.pop("MG_NLTK_DATA", None)
    else:
        os.environ["MG_NLTK_DATA"] = old


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Real text, edge cases, and one document longer than Megatron's 1M-character piece."""
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    botchan = "\n\n".join(d["text"] for d in botchan_documents())
    long_text = (botchan + "\n\n") * (1_100_000 // len(botchan) + 1)

    def documents():
        yield from real_corpus(wikipedia_pages=25)
        yield {"text": long_text[:1_100_000], "title": "long"}
        yield {"text": "", "title": ""}

    write_jsonl(path, documents())
    return path


GPT2_ARGS = [
    "--tokenizer-type",
    "GPT2BPETokenizer",
    "--vocab-file",
    str(fixture_path("gpt2-bpe", "vocab.json")),
    "--merge-file",
    str(fixture_path("gpt2-bpe", "merges.txt")),
]
BERT_ARGS = [
    "--tokenizer-type",
    "BertWordPieceLowerCase",
    "--vocab-file",
    str(fixture_dir("minilm-bert") / "vocab.txt"),
]


def mg_prep(*args: object) -> int:
    try:
        main([str(a) for a in args])
    except SystemExit as exit_:
        return int(exit_.code or 0)
    return 0


def assert_same_files(ours: str, theirs: str) -> None:
    for suffix in (".bin", ".idx"):
        a, b = Path(ours + suffix).read_bytes(), Path(theirs + suffix).read_bytes()
        assert len(a) == len(b), f"{suffix}: {len(a)} bytes, Megatron's reference {len(b)}"
        assert a == b, f"{suffix} differs from Megatron's reference"


# --- the comparisons -------------------------------------------------------------------------


def test_gpt2_document_level_append_eod_identical(corpus, tmp_path):
    """GPT2BPETokenizer --append-eod, document level: the MUST-match case."""
    reference = OpenAIGPT2(
        fixture_path("gpt2-bpe", "vocab.json"), fixture_path("gpt2-bpe", "merges.txt")
    )
    megatron_preprocess(
        corpus, str(tmp_path / "ref"), reference, ["text"], False, False, True, None
    )
    status = mg_prep(
        "tokenize", "--input", corpus, "--output-prefix", tmp_path / "ours",
        *GPT2_ARGS, "--append-eod", "--workers", 2,
    )  # fmt: skip
    assert status == 0
    assert_same_files(str(tmp_path / "ours_text_document"), str(tmp_path / "ref_text_document"))


def test_bert_sentence_level_identical(corpus, nltk_data, tmp_path):
    """BertWordPieceLowerCase --split-sentences: the other MUST-match case."""
    reference = GoogleBertWordPiece(fixture_dir("minilm-bert") / "vocab.txt")
    megatron_preprocess(
        corpus, str(tmp_path / "ref"), reference, ["text"], True, False, False, nltk_data
    )
    status = mg_prep(
        "tokenize", "--input", corpus, "--output-prefix", tmp_path / "ours",
        *BERT_ARGS, "--split-sentences", "--workers", 2,
    )  # fmt: skip
    assert status == 0
    assert_same_files(str(tmp_path / "ours_text_sentence"), str(tmp_path / "ref_text_sentence"))


@pytest.mark.parametrize("tokenizer", ["gpt2", "bert"])
def test_keep_newlines_two_keys_append_eod_identical(corpus, nltk_data, tmp_path, tokenizer):
    """--split-sentences --keep-newlines --append-eod with two --json-keys: both datasets match."""
    if tokenizer == "gpt2":
        reference = OpenAIGPT2(
            fixture_path("gpt2-bpe", "vocab.json"), fixture_path("gpt2-bpe", "merges.txt")
        )
        args = GPT2_ARGS
    else:
        reference = GoogleBertWordPiece(fixture_dir("minilm-bert") / "vocab.txt")
        args = BERT_ARGS
    keys = ["text", "title"]
    megatron_preprocess(corpus, str(tmp_path / "ref"), reference, keys, True, True, True, nltk_data)
    status = mg_prep(
        "tokenize", "--input", corpus, "--output-prefix", tmp_path / "ours", *args,
        "--json-keys", *keys, "--split-sentences", "--keep-newlines", "--append-eod",
        "--workers", 1,
    )  # fmt: skip
    assert status == 0
    for key in keys:
        assert_same_files(
            str(tmp_path / f"ours_{key}_sentence"), str(tmp_path / f"ref_{key}_sentence")
        )


def test_reference_tokenizers_behave_like_megatrons():
    """Guard the reference itself: a literal <|endoftext|> is text; BERT gets [BOS]/[EOS]."""
    gpt2 = OpenAIGPT2(
        fixture_path("gpt2-bpe", "vocab.json"), fixture_path("gpt2-bpe", "merges.txt")
    )
    assert gpt2.eod not in gpt2.tokenize("a <|endoftext|> b")
    assert gpt2.tokenize("Hello world") == [15496, 995]
    bert = GoogleBertWordPiece(fixture_dir("minilm-bert") / "vocab.txt")
    assert bert.vocab_size == 30524 and bert.eod == 30523
