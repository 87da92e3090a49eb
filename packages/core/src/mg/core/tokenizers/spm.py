"""SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer: from one ``.model``.

All three run Google's ``sentencepiece`` (C++). They differ, as in Megatron,
in what they add around it:

- ``SentencePieceTokenizer`` (BERT/T5-style use) adds ``<CLS>``, ``<SEP>``,
  ``<EOD>``, ``<MASK>`` (and ``<PAD>``/``<BOS>``/``<EOS>`` when the model has
  no such piece) after the model's pieces, then ``<extra_id_N>`` for
  ``--vocab-extra-ids``; these strings *are* recognised in text (NeMo's
  splitting scheme, which Megatron copied), and eod is ``<EOD>``;
- ``GPTSentencePieceTokenizer`` is the bare model: eod = eos, pad is the
  model's ``pad_id()`` (-1 when it has none), cls/sep/mask are -1;
- ``Llama2Tokenizer`` is the same but ``tokenize`` puts bos in front by
  default (Megatron's ``tokenize(s, bos=True, eos=False)``), so every
  document (or sentence) written by preprocessing starts with ``<s>``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import sentencepiece

from .base import BaseTokenizer, as_id_list, require_file
from .long_text import iter_pieces


def load_sentencepiece(
    model_file: str | Path | None, tokenizer_type: str
) -> sentencepiece.SentencePieceProcessor:
    """The model, or a ValueError that names ``--tokenizer-model`` and the path."""
    path = require_file(model_file, "--tokenizer-model", tokenizer_type, "a SentencePiece .model")
    try:
        return sentencepiece.SentencePieceProcessor(model_file=str(path))
    except (RuntimeError, OSError) as err:
        raise ValueError(
            f"--tokenizer-model {model_file}: not a SentencePiece model ({err})"
        ) from err


def _piece_or(sp: sentencepiece.SentencePieceProcessor, piece_id: int, fallback: str) -> str:
    # Megatron: id_to_piece(pad_id()) raises IndexError for -1; then it adds its own token.
    if 0 <= piece_id < sp.get_piece_size():
        return sp.id_to_piece(piece_id)
    return fallback


class _SentencePieceBase(BaseTokenizer):
    def __init__(self, model_file: str | Path | None) -> None:
        super().__init__()
        self._sp = load_sentencepiece(model_file, self.name)
        self._vocab: dict[str, int] = {}
        self._inv_vocab: dict[int, str] = {}
        for i in range(self._sp.get_piece_size()):
            piece = self._sp.id_to_piece(i)
            self._vocab[piece] = i
            self._inv_vocab[i] = piece
        self._cut_space = cut_space_rule(self._sp, self._vocab)

    def _encode(self, text: str) -> list[int]:
        """``sp.encode(text)``, in pieces for a long text when the model allows it."""
        if len(text) <= self.piece_chars or self._cut_space is None:
            return self._sp.encode(text)
        return [i for ids in self._encode_pieces(text) for i in ids]

    def _encode_pieces(self, text: str) -> Iterator[list[int]]:
        if len(text) <= self.piece_chars or self._cut_space is None:
            yield self._sp.encode(text)
            return
        for k, piece in enumerate(iter_pieces(text, self.piece_chars)):
            # Every piece after the first starts with the space it was cut at.
            yield self._sp.encode(piece[1:] if k and self._cut_space == "strip" else piece)

    def _encode_all(self, texts: list[str]) -> list[list[int]]:
        if self.has_long_text(texts):
            return [self._encode(text) for text in texts]
        return self._sp.encode(texts)

    @property
    def vocab(self) -> dict[str, int]:
        return self._vocab

    @property
    def inv_vocab(self) -> dict[int, str]:
        return self._inv_vocab

    def id_to_token(self, i: int) -> str:
        """The piece (with its ``▁``), as Megatron's server shows SentencePiece tokens."""
        return self._inv_vocab[i]


def cut_space_rule(sp: sentencepiece.SentencePieceProcessor, vocab: dict[str, int]) -> str | None:
    """How to encode a piece that starts with the space a long text was cut at.

    ``"strip"``: drop that space, the normalizer's dummy prefix puts the ``▁``
    back; ``"keep"``: encode it as is; None: this model cannot be cut (its
    normalizer does not treat "a b" as "a" + "b", or a vocabulary piece
    spans a word boundary), so texts are encoded whole.
    """
    whole, first = sp.normalize("a b"), sp.normalize("a")
    if whole == first + sp.normalize("b"):
        rule = "strip"
    elif whole == first + sp.normalize(" b"):
        rule = "keep"
    else:
        return None
    # A word's ▁ is its first character (or, with treat_whitespace_as_suffix, its last);
    # a piece holding a ▁ next to a non-▁ on the other side would cross the cut.
    across = re.compile("▁[^▁]" if first.endswith("▁") else "[^▁]▁")
    if any(across.search(piece) for piece in vocab):
        return None
    return rule


class SentencePieceTokenizer(_SentencePieceBase):
    """Megatron's ``_SentencePieceTokenizer``."""

    name = "SentencePieceTokenizer"

    def __init__(self, model_file: str | Path | None, vocab_extra_ids: int = 0) -> None:
        super().__init__(model_file)
        # Insertion order matters: at equal positions in the text, the first
        # special token in this order wins, as in Megatron's search loop.
        self._special_tokens: dict[str, int] = {}
        self.cls = self._add_special("<CLS>")
        self.sep = self._add_special("<SEP>")
        self.eod = self._add_special("<EOD>")
        self.mask = self._add_special("<MASK>")
        self.pad = self._add_special(_piece_or(self._sp, self._sp.pad_id(), "<PAD>"))
        self.bos = self._add_special(_piece_or(self._sp, self._sp.bos_id(), "<BOS>"))
        self.eos = self._add_special(_piece_or(self._sp, self._sp.eos_id(), "<EOS>"))
        extra = [f"<extra_id_{i}>" for i in range(vocab_extra_ids)]
        self.additional_special_tokens_ids = [self._add_special(t) for t in extra]
        self._inv_special_tokens = {i: t for t, i in self._special_tokens.items()}
        self._special_re = re.compile("|".join(re.escape(t) for t in self._special_tokens))
        self.vocab_size = len(self._vocab)

    def _add_special(self, token: str) -> int:
        if token not in self._vocab:
            self._vocab[token] = len(self._vocab)
            self._inv_vocab[self._vocab[token]] = token
        self._special_tokens[token] = self._vocab[token]
        return self._vocab[token]

    def _segments(self, text: str) -> tuple[list[str], list[int]]:
        """Plain-text pieces between special tokens, and the special ids between them."""
        pieces, specials, start = [], [], 0
        for match in self._special_re.finditer(text):
            pieces.append(text[start : match.start()])
            specials.append(self._special_tokens[match.group()])
            start = match.end()
        pieces.append(text[start:])
        return pieces, specials

    def tokenize(self, text: str) -> list[int]:
        pieces, specials = self._segments(text)
        return _interleave(self._encode_all(pieces), specials)

    def tokenize_in_pieces(self, text: str) -> Iterator[list[int]]:
        pieces, specials = self._segments(text)
        yield from self._encode_pieces(pieces[0])
        for special, piece in zip(specials, pieces[1:], strict=True):
            yield [special]
            yield from self._encode_pieces(piece)

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        split = [self._segments(text) for text in texts]
        encoded = self._encode_all([p for pieces, _ in split for p in pieces])
        out, at = [], 0
        for pieces, specials in split:
            out.append(_interleave(encoded[at : at + len(pieces)], specials))
            at += len(pieces)
        return out

    def detokenize(self, ids: Sequence[int]) -> str:
        """Megatron's: decode runs between special tokens, each special token spaced."""
        ids = as_id_list(ids)
        text, last = "", 0
        for i, token_id in enumerate(ids):
            if token_id in self._inv_special_tokens:
                text += self._sp.decode_ids(ids[last:i]) + " "
                text += self._inv_special_tokens[token_id] + " "
                last = i + 1
        return text + self._sp.decode_ids(ids[last:])


def _interleave(encoded: list[list[int]], specials: list[int]) -> list[int]:
    ids = list(encoded[0])
    for special, piece_ids in zip(specials, encoded[1:], strict=True):
        ids.append(special)
        ids.extend(piece_ids)
    return ids


class GPTSentencePieceTokenizer(_SentencePieceBase):
    """Megatron's ``_GPTSentencePieceTokenizer``: the bare model, eod = eos."""

    name = "GPTSentencePieceTokenizer"

    def __init__(self, model_file: str | Path | None) -> None:
        super().__init__(model_file)
        self.pad = self._sp.pad_id()
        self.bos = self._sp.bos_id()
        self.eos = self._sp.eos_id()
        self.eod = self.eos
        self.cls = self.sep = self.mask = -1
        self.vocab_size = len(self._vocab)

    def tokenize(self, text: str) -> list[int]:
        return self._encode(text)

    def tokenize_in_pieces(self, text: str) -> Iterator[list[int]]:
        return self._encode_pieces(text)

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return self._encode_all(list(texts))

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._sp.decode_ids(as_id_list(ids))


class Llama2Tokenizer(GPTSentencePieceTokenizer):
    """Megatron's ``_Llama2Tokenizer``: bos in front by default."""

    name = "Llama2Tokenizer"

    def tokenize(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        return self._wrap(self._encode(text), bos, eos)

    def tokenize_in_pieces(self, text: str) -> Iterator[list[int]]:
        yield [self.bos]
        yield from self._encode_pieces(text)

    def tokenize_batch(
        self, texts: list[str], bos: bool = True, eos: bool = False
    ) -> list[list[int]]:
        return [self._wrap(ids, bos, eos) for ids in self._encode_all(list(texts))]

    def _wrap(self, ids: list[int], bos: bool, eos: bool) -> list[int]:
        if bos:
            ids = [self.bos, *ids]
        if eos:
            ids = [*ids, self.eos]
        return ids
