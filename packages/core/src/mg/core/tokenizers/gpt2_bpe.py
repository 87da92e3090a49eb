"""GPT2BPETokenizer: OpenAI's byte-level BPE from vocab.json + merges.txt.

Megatron's classic GPT-2 tokenizer is a pure-Python port of OpenAI's
``encoder.py`` with no special tokens: a literal ``<|endoftext|>`` in a
document is ordinary text (several tokens) and only ``--append-eod`` adds id
50256. We give the same ids from one of two Rust engines:

- ``tiktoken`` (about 4x faster), when the merges are *rank consistent*: merge
  ``k`` creates token id ``256 + k`` and, for every token, merging its bytes
  by lowest token id (tiktoken's rule) ends in exactly its own merge pair.
  Then "merge the lowest-ranked pair" and "merge into the lowest-ranked
  token" pick the same pair at every step, so the ids are identical. OpenAI's
  GPT-2 files are (checked once by fingerprint, or by the 0.3 s check below
  for any other files).
- Hugging Face ``tokenizers`` BPE otherwise: the same algorithm as
  ``encoder.py`` for any vocab/merges pair.

Neither engine is given any special token to look for in the text.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Literal

import tiktoken
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from .base import BaseTokenizer, as_id_list, require_file
from .long_text import encode_in_pieces, iter_encoded

EOD_TOKEN = "<|endoftext|>"

# GPT-2's pre-tokenization regex (Megatron's gpt2_tokenization.py; the
# contractions are written as one group, which matches the same strings).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# sha256 of OpenAI's GPT-2 vocabulary as _fingerprint() computes it; these
# files are known to be rank consistent, so they skip the check.
_OPENAI_GPT2_FINGERPRINT = "ac33235097fe06d4a8fff0feac994644809e6eb6ab70669e1e9fd40ae032428e"

Backend = Literal["auto", "tiktoken", "tokenizers"]


@lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """GPT-2's printable-unicode stand-in for each byte, inverted (char -> byte)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    byte_to_char = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in byte_to_char:
            byte_to_char[b] = chr(256 + n)
            n += 1
    return {c: b for b, c in byte_to_char.items()}


class GPT2BPETokenizer(BaseTokenizer):
    """Megatron's ``_GPT2BPETokenizer``: GPT-2 ids, eod = eos = ``<|endoftext|>``.

    ``backend`` picks the engine (``auto``: tiktoken when the files allow it);
    the ids do not depend on it.
    """

    name = "GPT2BPETokenizer"

    def __init__(
        self,
        vocab_file: str | Path | None,
        merge_file: str | Path | None,
        backend: Backend = "auto",
    ) -> None:
        super().__init__()
        vocab_path = require_file(vocab_file, "--vocab-file", self.name, "GPT-2 vocab.json")
        merges_path = require_file(merge_file, "--merge-file", self.name, "GPT-2 merges.txt")
        try:
            with vocab_path.open(encoding="utf-8") as f:
                vocab: dict[str, int] = json.load(f)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"--vocab-file {vocab_file}: not a JSON vocabulary ({err})") from err
        if not isinstance(vocab, dict) or EOD_TOKEN not in vocab:
            raise ValueError(f"--vocab-file {vocab_file}: has no {EOD_TOKEN} token")
        merges = read_merges(merges_path)

        self._vocab = vocab
        self._inv_vocab = {i: t for t, i in vocab.items()}
        self.vocab_size = len(vocab)
        self.eod = vocab[EOD_TOKEN]
        self.eos = self.eod

        if backend == "auto":
            backend = "tiktoken" if rank_consistent(vocab, merges) else "tokenizers"
        elif backend == "tiktoken" and not rank_consistent(vocab, merges):
            raise ValueError(
                f"{vocab_file} + {merge_file}: merges are not rank consistent, "
                "tiktoken would give different ids; use backend='tokenizers'"
            )
        self.backend: str = backend
        self._tiktoken: tiktoken.Encoding | None = None
        self._hf: HFTokenizer | None = None
        if backend == "tiktoken":
            self._tiktoken = _tiktoken_encoding(vocab, self.eod)
        elif backend == "tokenizers":
            self._hf = _hf_tokenizer(vocab, merges)
        else:
            raise ValueError(f"unknown GPT-2 backend {backend!r}: auto, tiktoken or tokenizers")

    @property
    def vocab(self) -> dict[str, int]:
        """Token (GPT-2's byte-as-unicode form) to id."""
        return self._vocab

    @property
    def inv_vocab(self) -> dict[int, str]:
        return self._inv_vocab

    def tokenize(self, text: str) -> list[int]:
        # In pieces cut where GPT-2's pattern splits anyway: whole, tokenizers keeps
        # ~330 bytes a token (9.5 GB for a 50 MB document).
        return encode_in_pieces(text, self._encode, self.piece_chars)

    def tokenize_in_pieces(self, text: str) -> Iterator[list[int]]:
        return iter_encoded(text, self._encode, self.piece_chars)

    def _encode(self, text: str) -> list[int]:
        if self._tiktoken is not None:
            return self._tiktoken.encode_ordinary(text)
        assert self._hf is not None
        return self._hf.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        if self.has_long_text(texts):
            return [self.tokenize(text) for text in texts]
        if self._tiktoken is not None:
            # A plain loop: tiktoken's encode_ordinary_batch hands each text to a
            # thread pool, which costs more than it gains for document-sized
            # texts (measured 6.4 vs 10.2 MB/s on Botchan in ~1 KB documents).
            # mg-prep parallelises across processes instead.
            encode = self._tiktoken.encode_ordinary
            return [encode(text) for text in texts]
        assert self._hf is not None
        return [e.ids for e in self._hf.encode_batch_fast(texts, add_special_tokens=False)]

    def detokenize(self, ids: Sequence[int]) -> str:
        # Both engines join the tokens' bytes and decode UTF-8 with U+FFFD for
        # invalid sequences, as Megatron's errors="replace".
        ids = as_id_list(ids)
        if self._tiktoken is not None:
            return self._tiktoken.decode(ids, errors="replace")
        assert self._hf is not None
        return self._hf.decode(ids, skip_special_tokens=False)

    def id_to_token(self, i: int) -> str:
        """The token's text (its bytes decoded, invalid UTF-8 replaced), as Megatron's server."""
        decode = byte_decoder()
        return bytes(decode[c] for c in self._inv_vocab[i]).decode("utf-8", errors="replace")


def read_merges(path: Path) -> list[tuple[str, str]]:
    """merges.txt as Megatron reads it: skip the ``#version`` line, one pair per line."""
    with path.open(encoding="utf-8") as f:
        lines = f.read().split("\n")
    start = 1 if lines and lines[0].startswith("#version") else 0
    merges = []
    for number, line in enumerate(lines[start:], start=start + 1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"--merge-file {path}, line {number}: expected two tokens: {line!r}")
        merges.append((parts[0], parts[1]))
    return merges


def rank_consistent(vocab: dict[str, int], merges: list[tuple[str, str]]) -> bool:
    """Whether tiktoken's lowest-token-id merging reproduces these BPE merges exactly."""
    decode = byte_decoder()
    if any(vocab.get(c) is None for c in decode):  # every byte must be a token
        return False
    if len(vocab) - 1 != 256 + len(merges):  # bytes + one token per merge + <|endoftext|>
        return False
    if any(vocab.get(a + b) != 256 + k for k, (a, b) in enumerate(merges)):
        return False
    if sorted(vocab[c] for c in decode) != list(range(256)) or vocab[EOD_TOKEN] != len(vocab) - 1:
        return False
    if _fingerprint(merges) == _OPENAI_GPT2_FINGERPRINT:
        return True
    return all(_merge_by_rank(a + b, vocab, 256 + k) == [a, b] for k, (a, b) in enumerate(merges))


def _merge_by_rank(token: str, vocab: dict[str, int], limit: int) -> list[str]:
    """tiktoken's rule on one token's bytes, using only tokens with id < limit."""
    parts = list(token)
    while len(parts) > 1:
        best, at = limit, -1
        for i in range(len(parts) - 1):
            rank = vocab.get(parts[i] + parts[i + 1])
            if rank is not None and rank < best:
                best, at = rank, i
        if at < 0:
            break
        parts[at : at + 2] = [parts[at] + parts[at + 1]]
    return parts


def _fingerprint(merges: list[tuple[str, str]]) -> str:
    # Given the checks before it (ids follow merges), the merges determine the vocab.
    digest = hashlib.sha256()
    for a, b in merges:
        digest.update(f"{a} {b}\n".encode())
    return digest.hexdigest()


def _tiktoken_encoding(vocab: dict[str, int], eod: int) -> tiktoken.Encoding:
    decode = byte_decoder()
    ranks = {bytes(decode[c] for c in token): i for token, i in vocab.items() if i != eod}
    # <|endoftext|> is registered only so that decode() knows its bytes;
    # encode_ordinary never looks for it in the text.
    return tiktoken.Encoding(
        "mg-gpt2-bpe", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={EOD_TOKEN: eod}
    )


def _hf_tokenizer(vocab: dict[str, int], merges: list[tuple[str, str]]) -> HFTokenizer:
    tokenizer = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer
