"""Exact match and token F1 of short answers: SQuAD's normalisation, exact numbers."""

from __future__ import annotations

import pytest

from mg.evaluate.qa_metrics import answer_of, exact_match, normalize_answer, token_f1


@pytest.mark.parametrize(
    ("text", "normalized"),
    [
        ("The Eiffel Tower!", "eiffel tower"),
        ("  an  apple, a day ", "apple day"),
        ("Theater", "theater"),  # an article only as a whole word
        ("U.S.A.", "usa"),  # punctuation deleted, not replaced by a space
        ("rock-n-roll", "rocknroll"),
        ("A", ""),
    ],
)
def test_normalize_answer(text: str, normalized: str) -> None:
    assert normalize_answer(text) == normalized


def test_exact_match_is_any_gold_answer() -> None:
    assert exact_match("the Eiffel tower.", ["Tour Eiffel", "Eiffel Tower"]) == 1.0
    assert exact_match("Eiffel", ["Eiffel Tower"]) == 0.0


def test_token_f1_exact_numbers() -> None:
    # "eiffel tower in paris" vs "eiffel tower": P = 2/4, R = 1, F1 = 2/3
    assert token_f1("The Eiffel Tower in Paris", ["Eiffel Tower"]) == pytest.approx(2 / 3)
    # "eiffel tower paris" vs "eiffel tower": P = 2/3, R = 1, F1 = 0.8
    assert token_f1("Eiffel Tower, Paris", ["the Eiffel Tower"]) == pytest.approx(0.8)
    # "new york city" vs "york": P = 1/3, R = 1, F1 = 0.5; the best answer counts
    assert token_f1("New York City", ["York"]) == pytest.approx(0.5)
    assert token_f1("New York City", ["York", "new york city"]) == 1.0
    # a repeated word matches as often as both sides hold it: 2 shared, P = R = 2/3
    assert token_f1("x x y", ["x y y"]) == pytest.approx(2 / 3)
    assert token_f1("nothing shared", ["Eiffel Tower"]) == 0.0
    assert token_f1("", ["Eiffel Tower"]) == 0.0
    assert token_f1("The", ["a"]) == 1.0  # both normalise to nothing


def test_answer_of_takes_the_first_line() -> None:
    assert answer_of(" Paris\nQuestion: next") == "Paris"
    assert answer_of("Answer: 1889<|endoftext|>more") == "1889"
    assert answer_of("\n") == ""
