"""Streaming de-duplication: exact (content hash) and near (MinHash LSH).

Both keep only what they need to recognise a later copy, so a corpus streams
through in one pass and the first copy of each document is the one kept.

Memory is O(kept documents), never O(text):

- exact: one 16-byte BLAKE2b digest per kept document (about 100 bytes each
  in a Python set, so ~1 GB per 10M documents);
- near: per kept document, its MinHash signature (4·num_perm bytes, 512 at
  the default 128) plus the LSH band keys (about 8·num_perm bytes), so
  ~1.5 KB per document at the default.

Exact duplicates are judged on a normalised form of the text (case-folded,
whitespace runs collapsed), so copies differing only in case or spacing
count as the same document.

Near duplicates follow Megatron's OpenWebText recipe
(tools/openwebtext/find_duplicates.py): Jaccard similarity of the sets of
character 5-grams ("shingles"), estimated with MinHash. LSH proposes
candidates, tuned to a threshold 0.1 below the user's (so that pairs at the
threshold are found with high probability: banding alone misses many of them,
and cannot even be set up for thresholds near 1); a candidate only counts when
its estimated Jaccard similarity is at least the threshold, which keeps the
extra candidates out.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:  # datasketch pulls in scipy (2 s): imported when a MinHash is built
    from datasketch import MinHash, MinHashLSH

EXACT_DUPLICATE = "exact_duplicate"
NEAR_DUPLICATE = "near_duplicate"


class Deduplicator(Protocol):
    def check_and_add(self, text: str) -> str | None:
        """The drop reason if `text` duplicates a kept document; else remember it, return None."""
        ...


def normalized_for_hash(text: str) -> str:
    """Case-folded, with every whitespace run made one space: the form exact duplicates share."""
    return " ".join(text.casefold().split())


def content_digest(text: str) -> bytes:
    """16-byte BLAKE2b digest of the normalised text."""
    return hashlib.blake2b(normalized_for_hash(text).encode("utf-8"), digest_size=16).digest()


class ExactDeduplicator:
    """Drops documents whose normalised text was seen before."""

    def __init__(self) -> None:
        self._seen: set[bytes] = set()

    def __len__(self) -> int:
        return len(self._seen)

    def check_and_add(self, text: str) -> str | None:
        digest = content_digest(text)
        if digest in self._seen:
            return EXACT_DUPLICATE
        self._seen.add(digest)
        return None


def shingles(text: str, size: int = 5) -> set[bytes]:
    """The set of character `size`-grams of the normalised text (the whole text if shorter)."""
    text = normalized_for_hash(text)
    if len(text) <= size:
        return {text.encode("utf-8")}
    return {text[i : i + size].encode("utf-8") for i in range(len(text) - size + 1)}


def jaccard(a: set[bytes], b: set[bytes]) -> float:
    """Exact Jaccard similarity of two shingle sets (for tests and reports)."""
    return len(a & b) / len(a | b) if a or b else 1.0


class NearDeduplicator:
    """Drops documents whose estimated shingle Jaccard similarity to a kept one is >= threshold."""

    def __init__(
        self, threshold: float = 0.8, num_perm: int = 128, shingle_size: int = 5, seed: int = 1234
    ) -> None:
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"the MinHash threshold must be in (0, 1], got {threshold}")
        if num_perm < 2:
            raise ValueError(f"num_perm must be at least 2, got {num_perm}")
        self.threshold = threshold
        self.num_perm = num_perm
        self.shingle_size = shingle_size
        self.seed = seed
        # lazy: datasketch pulls in scipy (seconds); only --dedup near builds a MinHash
        from datasketch import MinHash

        self._lsh = _candidate_index(threshold, num_perm)
        # The permutations are drawn once and shared: drawing them per document
        # would cost more than hashing a short document.
        self._permutations = MinHash(num_perm=num_perm, seed=seed).permutations
        self._signatures: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self._signatures)

    def signature(self, text: str) -> MinHash:
        # lazy: datasketch pulls in scipy (seconds); only --dedup near builds a MinHash
        from datasketch import MinHash

        minhash = MinHash(
            num_perm=self.num_perm,
            seed=self.seed,
            permutations=self._permutations,
            scheme="affine32",
        )
        minhash.update_batch(shingles(text, self.shingle_size))
        return minhash

    def check_and_add(self, text: str) -> str | None:
        minhash = self.signature(text)
        for key in self._lsh.query(minhash):
            similarity = float(np.mean(self._signatures[key] == minhash.hashvalues))
            if similarity >= self.threshold:
                return NEAR_DUPLICATE
        key = len(self._signatures)
        self._signatures[key] = minhash.hashvalues.copy()
        self._lsh.insert(key, minhash, check_duplication=False)
        return None


def _candidate_index(threshold: float, num_perm: int) -> MinHashLSH:
    """LSH bands tuned below `threshold` (see the module docstring)."""
    # lazy: datasketch pulls in scipy (seconds); only --dedup near builds a MinHash
    from datasketch import MinHashLSH

    looser = min(max(threshold - 0.1, 0.05), 0.9)
    try:
        return MinHashLSH(threshold=looser, num_perm=num_perm)
    except ValueError:  # too few permutations for two bands at this threshold
        return MinHashLSH(num_perm=num_perm, params=(2, num_perm // 2))


class ChainedDeduplicator:
    """Exact first (cheap, and certain), then near."""

    def __init__(self, *parts: Deduplicator) -> None:
        self.parts = parts

    def check_and_add(self, text: str) -> str | None:
        for part in self.parts:
            reason = part.check_and_add(text)
            if reason is not None:
                return reason
        return None


def build_deduplicator(
    mode: str, threshold: float = 0.8, num_perm: int = 128, shingle_size: int = 5, seed: int = 1234
) -> Deduplicator | None:
    """None for ``"none"``; exact hashing for ``"exact"``; exact then MinHash for ``"near"``."""
    if mode == "none":
        return None
    if mode == "exact":
        return ExactDeduplicator()
    if mode == "near":
        return ChainedDeduplicator(
            ExactDeduplicator(), NearDeduplicator(threshold, num_perm, shingle_size, seed)
        )
    raise ValueError(f"unknown dedup mode {mode!r}: use none, exact or near")
