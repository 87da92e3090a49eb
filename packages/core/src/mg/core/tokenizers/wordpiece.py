"""BertWordPieceLowerCase / BertWordPieceCase: Megatron's BERT WordPiece tokenizer.

Megatron runs Google's original pure-Python ``FullTokenizer``. We run the
same steps in Hugging Face ``tokenizers`` (Rust), built from regexes rather
than its ``BertNormalizer``/``BertPreTokenizer``, because those differ from
Megatron's Python on a few inputs that real text contains:

- Megatron removes only control (Cc) and format (Cf) characters; the Rust
  normalizer also drops private-use and unassigned characters (Megatron keeps
  them, and the word they are in becomes ``[UNK]``);
- Python's ``str.lower()`` turns a word-final capital sigma into "ς", the Rust
  per-character lowercase into "σ";
- the Rust CJK ranges skip U+2B820..U+2B91F, and its punctuation tables are
  older than Python's.

The regexes use Oniguruma's Unicode tables, which agree with Python's
``unicodedata`` (tested on 40,000 random strings). Characters assigned after
Unicode 14 (Python 3.11) follow the newer tables, i.e. Megatron run on Python
3.12+; e.g. U+11F44 KAWI DOUBLE DANDA is punctuation here, unassigned on 3.11.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

from tokenizers import Regex, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import WordPiece

from .base import BaseTokenizer, as_id_list, clean_up_tokenization, require_file
from .long_text import encode_in_pieces, iter_encoded

# Removed before anything else (Megatron's _clean_text): NUL, U+FFFD and every
# Cc/Cf character except the tab and newlines, which count as whitespace.
_CONTROL = r"(?![\t\n\r])[\x00\x{FFFD}\p{Cc}\p{Cf}]"
# Python's str.lower() Final_Sigma rule: capital sigma after a cased letter and
# not before one (across case-ignorable characters) lowercases to final sigma.
_FINAL_SIGMA = r"(?<=\p{Cased}\p{Case_Ignorable}*)Σ(?!\p{Case_Ignorable}*\p{Cased})"
# Each becomes a word of its own: ASCII non-alphanumerics and Unicode P*
# (Megatron's _is_punctuation), and CJK ideographs (_tokenize_chinese_chars).
_ISOLATED = (
    r"[!-/:-@\[-`{-~\p{P}"
    r"\x{4E00}-\x{9FFF}\x{3400}-\x{4DBF}\x{20000}-\x{2A6DF}\x{2A700}-\x{2B73F}"
    r"\x{2B740}-\x{2B81F}\x{2B820}-\x{2CEAF}\x{F900}-\x{FAFF}\x{2F800}-\x{2FA1F}]"
)
# Google's WordpieceTokenizer default (transformers uses 100).
MAX_INPUT_CHARS_PER_WORD = 200
_REQUIRED = ("[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]")


def load_vocab(path: Path) -> dict[str, int]:
    """vocab.txt as Megatron's ``load_vocab``: line n is id n, each line stripped."""
    vocab: dict[str, int] = {}
    with path.open(encoding="utf-8") as f:
        for index, line in enumerate(f):
            vocab[line.strip()] = index  # a repeated token keeps its last id, as Megatron
    return vocab


def bert_hf_tokenizer(vocab: dict[str, int], lower_case: bool) -> HFTokenizer:
    """The WordPiece pipeline of Megatron's FullTokenizer, without [CLS]/[SEP]."""
    steps = [normalizers.Replace(Regex(_CONTROL), "")]
    if lower_case:  # Megatron strips accents exactly when it lower-cases
        steps += [
            normalizers.Replace(Regex(_FINAL_SIGMA), "ς"),
            normalizers.Lowercase(),
            normalizers.NFD(),
            normalizers.Replace(Regex(r"\p{Mn}"), ""),
        ]
    tokenizer = HFTokenizer(
        WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=MAX_INPUT_CHARS_PER_WORD)
    )
    tokenizer.normalizer = normalizers.Sequence(steps)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Split(Regex(_ISOLATED), behavior="isolated"),
        ]
    )
    return tokenizer


class BertWordPieceTokenizer(BaseTokenizer):
    """Megatron's ``_BertWordPieceTokenizer``.

    ``tokenize`` gives the word pieces only; [CLS]/[SEP] are added when
    training samples are built. As in Megatron, [BOS] and [EOS] are appended
    to the vocabulary when it lacks them (eod = eos = [EOS]), then
    ``<extra_id_0>``... for ``--vocab-extra-ids``. These added tokens are
    never matched in text (their brackets are punctuation).
    """

    def __init__(
        self, vocab_file: str | Path | None, lower_case: bool = True, vocab_extra_ids: int = 0
    ):
        super().__init__()
        self.name = "BertWordPieceLowerCase" if lower_case else "BertWordPieceCase"
        path = require_file(vocab_file, "--vocab-file", self.name, "a BERT vocab.txt")
        vocab = load_vocab(path)
        missing = [t for t in _REQUIRED if t not in vocab]
        if missing:
            raise ValueError(f"--vocab-file {vocab_file}: has no {', '.join(missing)} token")
        self.lower_case = lower_case
        self._tokenizer = bert_hf_tokenizer(vocab, lower_case)

        self._vocab = dict(vocab)
        self._inv_vocab = {i: t for t, i in vocab.items()}
        self.cls = vocab["[CLS]"]
        self.sep = vocab["[SEP]"]
        self.pad = vocab["[PAD]"]
        self.mask = vocab["[MASK]"]
        self.bos = self._add_token("[BOS]")
        self.eos = self._add_token("[EOS]")
        self.eod = self.eos
        extra = [f"<extra_id_{i}>" for i in range(vocab_extra_ids)]
        self.additional_special_tokens_ids = [self._add_token(t) for t in extra]
        self.vocab_size = len(self._vocab)

    def _add_token(self, token: str) -> int:
        # Megatron: a new token gets id len(vocab), an existing one keeps its id.
        if token not in self._vocab:
            self._inv_vocab[len(self._vocab)] = token
            self._vocab[token] = len(self._vocab)
        return self._vocab[token]

    @property
    def vocab(self) -> dict[str, int]:
        return self._vocab

    @property
    def inv_vocab(self) -> dict[int, str]:
        return self._inv_vocab

    def tokenize(self, text: str) -> list[int]:
        # In pieces cut at spaces (which always end a word): whole, tokenizers keeps
        # ~330 bytes a token.
        return encode_in_pieces(text, self._encode, self.piece_chars)

    def tokenize_in_pieces(self, text: str) -> Iterator[list[int]]:
        return iter_encoded(text, self._encode, self.piece_chars)

    def _encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        if self.has_long_text(texts):
            return [self.tokenize(text) for text in texts]
        return [e.ids for e in self._tokenizer.encode_batch_fast(texts, add_special_tokens=False)]

    def detokenize(self, ids: Sequence[int]) -> str:
        """Megatron's ``convert_tokens_to_string``: join, glue ``##`` pieces, tidy spaces."""
        text = " ".join(self._inv_vocab[i] for i in as_id_list(ids)).replace(" ##", "").strip()
        return clean_up_tokenization(text)

    def id_to_token(self, i: int) -> str:
        return self._inv_vocab[i]
