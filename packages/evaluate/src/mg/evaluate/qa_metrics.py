"""Exact match and token F1 of short answers, with SQuAD's answer normalisation.

``normalize_answer`` is the one Megatron's InstructRetro evaluation applies
(tools/retro/text_generation/evaluate.py, from SQuAD's script): lowercase, delete
ASCII punctuation, replace the articles a/an/the by a space, collapse whitespace.
Exact match is 1 when the normalised prediction equals any normalised gold answer.
Token F1 is SQuAD's: over the normalised words, the bag-of-words overlap's F1
against each gold answer, the best one kept (Megatron's F1 script compares with the
first gold answer only; with one answer per question the two agree).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    text = text.lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, answers: Sequence[str]) -> float:
    target = normalize_answer(prediction)
    return float(any(target == normalize_answer(a) for a in answers))


def _f1(prediction: list[str], gold: list[str]) -> float:
    if not prediction or not gold:
        return float(prediction == gold)  # both empty: a match; one empty: nothing shared
    same = sum((Counter(prediction) & Counter(gold)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(prediction), same / len(gold)
    return 2 * precision * recall / (precision + recall)


def token_f1(prediction: str, answers: Sequence[str]) -> float:
    words = normalize_answer(prediction).split()
    return max((_f1(words, normalize_answer(a).split()) for a in answers), default=0.0)


def answer_of(generated: str) -> str:
    """The answer in a generated continuation: its first line, an "Answer:" label and the
    end-of-text token taken off (as Megatron's evaluation reads its predictions)."""
    text = generated.replace("<|endoftext|>", "\n").strip().split("\n", 1)[0]
    for label in ("Answer:", "A:"):
        if text.startswith(label):
            text = text[len(label) :]
    return text.strip()
