"""Exact and MinHash near-duplicate detection on real text with known Jaccard similarities."""

from __future__ import annotations

import random

import pytest

from mg.core.fixtures import fixture_path
from mg.corpus_prep.dedup import (
    ExactDeduplicator,
    NearDeduplicator,
    build_deduplicator,
    content_digest,
    jaccard,
    shingles,
)


@pytest.fixture(scope="module")
def paragraphs() -> list[str]:
    # Botchan has no blank lines: cut it into 30-line passages (~2,000 characters).
    lines = fixture_path("botchan", "botchan.txt").read_text(encoding="utf-8").splitlines()
    return [" ".join(" ".join(lines[i : i + 30]).split()) for i in range(300, 660, 30)]


def mutate(text: str, fraction: float, seed: int) -> str:
    """Replace `fraction` of the words with a made-up one."""
    rng = random.Random(seed)
    words = text.split()
    for i in rng.sample(range(len(words)), int(len(words) * fraction)):
        words[i] = f"zq{rng.randrange(10**6)}"
    return " ".join(words)


def test_digest_is_16_bytes_and_normalised():
    assert len(content_digest("x")) == 16
    assert content_digest("Hello  World\n") == content_digest("hello world")
    assert content_digest("hello world") != content_digest("hello world.")


def test_exact_memory_is_one_digest_per_kept_document():
    dedup = ExactDeduplicator()
    for text in ["a", "b", "A", "c", "b"]:
        dedup.check_and_add(text)
    assert len(dedup) == 3


def test_shingles_are_character_5grams():
    assert shingles("Abc  Defg") == {b"abc d", b"bc de", b"c def", b" defg"}
    assert shingles("abc") == {b"abc"}
    assert jaccard(shingles("abcdef"), shingles("abcdeg")) == pytest.approx(1 / 3)


def test_near_duplicates_dropped_at_threshold_kept_below(paragraphs):
    original = paragraphs[0]
    close = mutate(original, 0.02, seed=1)  # a few words changed
    far = mutate(original, 0.25, seed=2)  # a quarter of the words changed
    close_j = jaccard(shingles(original), shingles(close))
    far_j = jaccard(shingles(original), shingles(far))
    assert 0.85 < close_j < 0.97, close_j
    assert 0.2 < far_j < 0.55, far_j

    dedup = NearDeduplicator(threshold=0.8, num_perm=128)
    assert dedup.check_and_add(original) is None
    assert dedup.check_and_add(close) == "near_duplicate"
    assert dedup.check_and_add(far) is None
    # unrelated paragraphs of the same book are kept
    assert [dedup.check_and_add(p) for p in paragraphs[1:]] == [None] * (len(paragraphs) - 1)

    # with the threshold above the pair's true similarity, the close copy is kept
    strict = NearDeduplicator(threshold=min(close_j + 0.1, 1.0), num_perm=256)
    assert strict.check_and_add(original) is None
    assert strict.check_and_add(close) is None
    # and just below it, dropped
    loose = NearDeduplicator(threshold=close_j - 0.1, num_perm=256)
    assert loose.check_and_add(original) is None
    assert loose.check_and_add(close) == "near_duplicate"


def test_near_mode_reports_exact_copies_as_exact(paragraphs):
    dedup = build_deduplicator("near", threshold=0.8)
    assert dedup.check_and_add(paragraphs[0]) is None
    assert dedup.check_and_add(paragraphs[0].upper()) == "exact_duplicate"
    assert dedup.check_and_add(mutate(paragraphs[0], 0.02, 1)) == "near_duplicate"


def test_bad_parameters():
    with pytest.raises(ValueError, match="threshold"):
        NearDeduplicator(threshold=1.5)
    with pytest.raises(ValueError, match="dedup mode"):
        build_deduplicator("fuzzy")
