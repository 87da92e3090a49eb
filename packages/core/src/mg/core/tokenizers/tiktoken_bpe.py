"""TikTokenizer: Megatron's tiktoken BPE, special tokens first, ranks shifted after them.

Megatron reserves ids ``0 .. num_special_tokens-1`` (default 1000) for
special tokens: the named ones (``<unk>``, ``<s>``, ``</s>``, ``<mask>``,
``<pad>``, ``<cls>``, ``<sep>`` by default) then ``<SPECIAL_k>`` fillers. A
BPE token of rank r gets id ``r + num_special_tokens``, and only the first
``vocab_size - num_special_tokens`` ranks are kept. Text is encoded with
``encode_ordinary``: special-token strings in the text stay text.

The ranks come from Megatron's JSON format (a list of ``{"rank",
"token_bytes", "token_str"}``) or from an OpenAI ``.tiktoken`` file (one
``base64 rank`` per line).
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import tiktoken

from .base import BaseTokenizer, as_id_list, require_file
from .long_text import encode_in_pieces, iter_encoded

PATTERN_V1 = r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
PATTERN_V2 = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PATTERNS = {"v1": PATTERN_V1, "v2": PATTERN_V2}
# megatron-core's default named special tokens; the classic tokenizer requires the first three.
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>")
_REQUIRED = ("<unk>", "<s>", "</s>")
DEFAULT_VOCAB_SIZE = 2**17


class TikTokenizer(BaseTokenizer):
    """Megatron's ``TikTokenizer``: eod = eos = ``</s>``, bos = ``<s>``.

    ``vocab_size`` (``--vocab-size``) is the total including the special
    block. Megatron defaults it to 131072 and fails when the rank file is
    smaller; here None means "131072, or all the ranks if there are fewer".
    """

    name = "TikTokenizer"

    def __init__(
        self,
        path: str | Path | None,
        pattern: str | None = "v2",
        vocab_size: int | None = None,
        num_special_tokens: int = 1000,
        special_tokens: Sequence[str] | None = None,
    ) -> None:
        super().__init__()
        rank_file = require_file(
            path, "--tokenizer-model", self.name, "a tiktoken .json or .tiktoken rank file"
        )
        pattern = pattern or "v2"
        if pattern not in PATTERNS:
            raise ValueError(f"--tiktoken-pattern {pattern!r}: expected 'v1' or 'v2'")
        specials = list(SPECIAL_TOKENS if special_tokens is None else special_tokens)
        if len(set(specials)) != len(specials):
            raise ValueError(f"--tokenizer-special-tokens has duplicates: {specials}")
        missing = [t for t in _REQUIRED if t not in specials]
        if missing:
            raise ValueError(f"--tokenizer-special-tokens must include {', '.join(missing)}")
        if num_special_tokens < len(specials):
            raise ValueError(
                f"--tiktoken-num-special-tokens {num_special_tokens} is smaller than the "
                f"{len(specials)} special tokens"
            )

        ranks = load_ranks(rank_file)
        if vocab_size is None:
            vocab_size = min(DEFAULT_VOCAB_SIZE, num_special_tokens + len(ranks))
        inner = vocab_size - num_special_tokens
        if inner <= 0:
            raise ValueError(
                f"--vocab-size {vocab_size} leaves no room after "
                f"{num_special_tokens} special tokens"
            )
        if inner > len(ranks):
            raise ValueError(
                f"--vocab-size {vocab_size} needs {inner} ranks after {num_special_tokens} "
                f"special tokens, but {path} has {len(ranks)}; use --vocab-size "
                f"{num_special_tokens + len(ranks)} or less"
            )
        kept = {token: rank + num_special_tokens for token, rank in ranks.items() if rank < inner}

        self._special_names = specials + [
            f"<SPECIAL_{i}>" for i in range(len(specials), num_special_tokens)
        ]
        self._encoding = tiktoken.Encoding(
            name=f"mg-{rank_file.stem}",
            pat_str=PATTERNS[pattern],
            mergeable_ranks=kept,
            special_tokens={t: i for i, t in enumerate(self._special_names)},
        )
        self.num_special_tokens = num_special_tokens
        self.vocab_size = vocab_size
        index = {t: i for i, t in enumerate(specials)}
        self.unk = index["<unk>"]
        self.bos = index["<s>"]
        self.eos = index["</s>"]
        self.eod = self.eos
        self.mask = index.get("<mask>")
        self.pad = index.get("<pad>")
        self.cls = index.get("<cls>")
        self.sep = index.get("<sep>")
        # megatron-core: the named special tokens other than unk/bos/eos.
        self.additional_special_tokens_ids = [index[t] for t in specials if t not in _REQUIRED]

    def tokenize(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        ids = encode_in_pieces(text, self._encoding.encode_ordinary, self.piece_chars)
        return self._wrap(ids, bos, eos)

    def tokenize_in_pieces(self, text: str) -> Iterator[list[int]]:
        return iter_encoded(text, self._encoding.encode_ordinary, self.piece_chars)

    def tokenize_batch(
        self, texts: list[str], bos: bool = False, eos: bool = False
    ) -> list[list[int]]:
        # A loop, not encode_ordinary_batch: see GPT2BPETokenizer.tokenize_batch.
        return [self.tokenize(text, bos, eos) for text in texts]

    def _wrap(self, ids: list[int], bos: bool, eos: bool) -> list[int]:
        if bos:
            ids = [self.bos, *ids]
        if eos:
            ids = [*ids, self.eos]
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._encoding.decode(as_id_list(ids), errors="replace")

    def id_to_token(self, i: int) -> str:
        if 0 <= i < self.num_special_tokens:
            return self._special_names[i]
        return self._encoding.decode_single_token_bytes(i).decode("utf-8", errors="replace")


def load_ranks(path: Path) -> dict[bytes, int]:
    """Token bytes to rank from Megatron's JSON list or an OpenAI ``.tiktoken`` file.

    The ranks must be 0..n-1 (both formats are written that way), so that
    "the first k ranks" is well defined.
    """
    try:
        load = _load_json_ranks if path.suffix == ".json" else _load_tiktoken_ranks
        ranks = load(path)
    except (ValueError, KeyError, TypeError, binascii.Error, UnicodeDecodeError) as err:
        raise ValueError(f"--tokenizer-model {path}: not a tiktoken rank file ({err})") from err
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"--tokenizer-model {path}: ranks are not 0..{len(ranks) - 1}")
    return ranks


def _load_json_ranks(path: Path) -> dict[bytes, int]:
    with path.open(encoding="utf-8") as f:
        entries = json.load(f)
    if not isinstance(entries, list):
        raise ValueError("expected a JSON list of {rank, token_bytes, token_str}")
    return {base64.b64decode(e["token_bytes"]): int(e["rank"]) for e in entries}


def _load_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    ranks = {}
    with path.open("rb") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ValueError(f"line {number}: expected '<base64 token> <rank>'")
            ranks[base64.b64decode(parts[0], validate=True)] = int(parts[1])
    return ranks
