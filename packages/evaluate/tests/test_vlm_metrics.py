"""Captioning (CIDEr-D, BLEU-4) and VQA (answer normalisation, accuracy) scores against
values worked out by hand from their definitions."""

from __future__ import annotations

import math

import pytest

from mg.evaluate.caption_metrics import bleu4, caption_tokens, cider_d
from mg.evaluate.vqa_metrics import normalize_answer, vqa_accuracy


def test_caption_tokens_drop_punctuation_and_case() -> None:
    assert caption_tokens("A well-known Cat, sitting.") == ["a", "well-known", "cat", "sitting"]
    assert caption_tokens("the dog's ball - red!") == ["the", "dog's", "ball", "red"]


def test_cider_d_of_two_exact_two_word_captions_is_five() -> None:
    """df(a) = 2 = |I|: weight 0; cat, dog, 'a cat', 'a dog': weight log 2. Unigram and
    bigram cosines are 1, tri- and 4-grams absent: 10 * (1 + 1 + 0 + 0) / 4 = 5."""
    score, per_image = cider_d(["a cat", "A dog."], [["a cat"], ["a dog"]])
    assert per_image == pytest.approx([5.0, 5.0])
    assert score == pytest.approx(5.0)


def test_cider_d_length_penalty_and_missing_ngrams() -> None:
    """'cat' against 'a cat': unigram cosine 1 (a weighs 0), no bigram, lengths differ by
    one: 10 * exp(-1 / 72) / 4."""
    score, per_image = cider_d(["cat", "a dog"], [["a cat"], ["a dog"]])
    assert per_image[0] == pytest.approx(2.5 * math.exp(-1 / 72))
    assert per_image[1] == pytest.approx(5.0)
    assert score == pytest.approx((2.5 * math.exp(-1 / 72) + 5.0) / 2)


def test_cider_d_averages_over_references_and_clips() -> None:
    """Image 1 has two references; 'a cat' matches only the first (cosine 1 on unigrams
    and bigrams), the second shares no weighted n-gram: 10 * (2 / 4) / 2 = 2.5. A wrong
    caption scores 0."""
    score, per_image = cider_d(["a cat", "a bird"], [["a cat", "a red fox"], ["a dog"]])
    assert per_image[0] == pytest.approx(2.5)
    assert per_image[1] == 0.0
    assert score == pytest.approx(1.25)


def test_bleu4_hand_computed() -> None:
    ref = "the cat sat on the mat"
    assert bleu4([ref], [[ref]]) == pytest.approx(1.0)
    # one word too many: p = 6/7, 5/6, 4/5, 3/4, no brevity penalty
    assert bleu4([ref + " today"], [[ref]]) == pytest.approx((3 / 7) ** 0.25)
    # one word short: every precision 1, brevity penalty exp(1 - 6/5)
    assert bleu4(["the cat sat on the"], [[ref]]) == pytest.approx(math.exp(-0.2))
    # no matching 4-gram: 0 (no smoothing)
    assert bleu4(["the cat the cat"], [[ref]]) == 0.0
    # the closest reference length (7, not 3) and counts clipped by the best reference
    assert bleu4([ref + " today"], [["a cat", ref + " now"]]) == pytest.approx(
        (6 / 7 * 5 / 6 * 4 / 5 * 3 / 4) ** 0.25
    )


def test_bleu4_equals_sacrebleu_on_pretokenized_text() -> None:
    sacrebleu = pytest.importorskip("sacrebleu")
    cands = ["a man rides a red horse on the beach", "two dogs play with a ball", "a cat"]
    refs = [["a man riding a horse on a beach", "a person on a red horse by the sea"],
            ["two dogs playing with a ball in the grass", "dogs play with a ball"],
            ["a small cat sleeping", "the cat is on a sofa"]]  # fmt: skip
    ours = bleu4(cands, refs)
    theirs = sacrebleu.corpus_bleu(
        cands, [list(r) for r in zip(*refs, strict=True)], tokenize="none", smooth_method="none"
    ).score
    assert ours * 100 == pytest.approx(theirs, abs=1e-9)


@pytest.mark.parametrize(
    ("raw", "normal"),
    [
        ("Two", "2"),
        ("the Dog.", "dog"),
        ("a red ball!", "red ball"),
        ("none", "0"),
        ("3.5", "3.5"),
        ("1,000", "1000"),
        ("yes, sir", "yes sir"),
        ("black/white", "black white"),
        ("dont know", "don't know"),
        ("  An   Apple\n", "apple"),
        ("ten (10)", "10 10"),
    ],
)
def test_vqa_normalisation(raw: str, normal: str) -> None:
    assert normalize_answer(raw) == normal


def test_vqa_accuracy_three_agreeing_annotators_count_fully() -> None:
    answers = ["2", "two", "2", "3", "three", "3", "3", "3", "2", "4"]
    assert vqa_accuracy("Two", answers) == 1.0  # 2, two, 2, 2: four matches
    assert vqa_accuracy("4", answers) == pytest.approx(1 / 3)
    assert vqa_accuracy("five", answers) == 0.0
    assert vqa_accuracy("The cat.", ["cat"]) == 1.0
