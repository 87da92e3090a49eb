"""Encoding a long text in pieces, with the ids of encoding it whole.

The Rust engines keep per-token state while they encode (``tokenizers``
holds offsets, token strings and word ids: about 330 bytes a token; the
SentencePiece normalizer an alignment per byte), so one 50 MB document
costs gigabytes. Every pre-tokenizer we run splits the text at a space that
sits between two ordinary characters anyway, so we cut the text only there,
encode the pieces one by one and concatenate their ids.

Why such a cut leaves the ids unchanged, for a cut at position ``p`` (the
piece after it starts with the space):

- regex pre-tokenizers (GPT-2's, tiktoken's v1/v2, Llama 3's): no
  alternative lets a match run from a non-space character into a following
  space (a space may only *start* a match, or belong to a run of
  whitespace), so a match ends at ``p``; the only lookahead, ``\\s+(?!\\S)``,
  looks one character past a whitespace run, and none ends next to ``p``;
  the patterns have no lookbehind, so the scan from ``p`` is the same;
- BERT's whitespace/punctuation splitting: a space always separates words;
- SentencePiece: the normalizer maps each character on its own and the
  models never merge across a word-initial ``▁`` (checked on the vocabulary
  when the tokenizer is built);
- BPE, WordPiece and Unigram then work inside one pre-token at a time.

"Ordinary" (`ordinary_char`) excludes what could change that: whitespace and
controls, combining marks, unassigned characters (a newer Unicode table
could call them anything), and characters whose NFKC form begins or ends
with a space (``¨`` is ``" \u0308"``).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Iterator
from functools import lru_cache

# Texts up to this many characters are encoded whole; longer ones in pieces of
# about this size (~16,000 tokens: a few MB of engine state, not gigabytes). Smaller
# pieces are also faster than larger ones: on 4 MB of text, 64 KiB pieces took
# 0.5-0.8x the time of 1 MiB pieces with SentencePiece, WordPiece and tokenizers'
# BPE (tiktoken: about the same).
PIECE_CHARS = 1 << 16

# A space with a non-space on both sides (Python's idea of space: refined below).
_CANDIDATE = re.compile(r"(?<=\S) (?=\S)")


@lru_cache(maxsize=4096)
def ordinary_char(char: str) -> bool:
    """A letter, number, punctuation or symbol that stays one non-space under NFKC."""
    if unicodedata.category(char)[0] not in "LNPS":
        return False
    normal = unicodedata.normalize("NFKC", char)
    return bool(normal) and not normal[0].isspace() and not normal[-1].isspace()


def cut_points(text: str, piece_chars: int = PIECE_CHARS, avoid: tuple[str, ...] = ()) -> list[int]:
    """Where to cut `text` (each cut just before a space) into pieces of about `piece_chars`.

    Empty for a text of at most `piece_chars` characters. A piece grows past
    `piece_chars` only where the text has no usable space (a run of text
    without spaces is encoded whole). `avoid` lists strings (added tokens)
    that no cut may come near: a cut is refused if one of them occurs within
    its length of the cut.
    """
    cuts: list[int] = []
    reach = max((len(s) for s in avoid), default=0)
    start = 0
    while len(text) - start > piece_chars:
        found = None
        for match in _CANDIDATE.finditer(text, start + piece_chars):
            p = match.start()
            if not (ordinary_char(text[p - 1]) and ordinary_char(text[p + 1])):
                continue
            if reach and _near(text, p, avoid, reach):
                continue
            found = p
            break
        if found is None:
            break
        cuts.append(found)
        start = found
    return cuts


def _near(text: str, p: int, avoid: tuple[str, ...], reach: int) -> bool:
    window = text[max(p - reach, 0) : p + reach + 1]
    lowered = window.lower()
    return any(s in window or s.lower() in lowered for s in avoid)


def pieces(text: str, piece_chars: int = PIECE_CHARS, avoid: tuple[str, ...] = ()) -> list[str]:
    """`text` cut at `cut_points` (the whole text as one piece when it is short)."""
    bounds = [0, *cut_points(text, piece_chars, avoid), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def iter_pieces(
    text: str, piece_chars: int = PIECE_CHARS, avoid: tuple[str, ...] = ()
) -> Iterator[str]:
    """`pieces`, one at a time (so that only one piece's copy exists at once)."""
    bounds = [0, *cut_points(text, piece_chars, avoid), len(text)]
    for a, b in zip(bounds, bounds[1:], strict=False):
        yield text[a:b]


def iter_encoded(
    text: str,
    encode: Callable[[str], list[int]],
    piece_chars: int = PIECE_CHARS,
    avoid: tuple[str, ...] = (),
) -> Iterator[list[int]]:
    """``encode(text)`` as consecutive lists of ids, one per piece of a long text."""
    if len(text) <= piece_chars:
        yield encode(text)
        return
    for piece in iter_pieces(text, piece_chars, avoid):
        yield encode(piece)


def encode_in_pieces(
    text: str,
    encode: Callable[[str], list[int]],
    piece_chars: int = PIECE_CHARS,
    avoid: tuple[str, ...] = (),
) -> list[int]:
    """``encode(text)``, computed piece by piece for a long text."""
    if len(text) <= piece_chars:
        return encode(text)
    ids: list[int] = []
    for piece_ids in iter_encoded(text, encode, piece_chars, avoid):
        ids.extend(piece_ids)
    return ids
