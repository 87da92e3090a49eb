"""VQA answer normalisation and accuracy, as the VQA evaluation (and Megatron's
evaluate_vqav2.py, which calls it) defines them.

An answer is normalised in two steps (the official `vqaEval.py`):

    punctuation  ; / [ ] " { } ( ) = + \\ _ - > < @ ` , ? ! are removed where they touch a
                 space or the text has a comma between digits ("1,000"), else replaced
                 by a space; a period not between digits is removed ("3.5" stays)
    words        lower case; number words zero..ten become digits ("none" → 0); the
                 articles a, an, the are dropped; apostrophe-less contractions get their
                 apostrophe back ("dont" → "don't")

Accuracy of a prediction against the annotators' answers: min(1, matches / 3)
(VQAv2's "3 of 10 humans agree" rule, as Megatron computes it); with a single answer
that is exact match after normalisation.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_PUNCT = [";", "/", "[", "]", '"', "{", "}", "(", ")", "=", "+", "\\", "_", "-", ">", "<", "@",
          "`", ",", "?", "!"]  # fmt: skip
_PERIOD_STRIP = re.compile(r"(?!<=\d)(\.)(?!\d)")
_COMMA_STRIP = re.compile(r"(\d)(,)(\d)")
_NUMBERS = {
    "none": "0", "zero": "0", "one": "1", "two": "2", "three": "3", "four": "4", "five": "5",
    "six": "6", "seven": "7", "eight": "8", "nine": "9", "ten": "10",
}  # fmt: skip
_ARTICLES = {"a", "an", "the"}
_CONTRACTIONS = {
    "aint": "ain't", "arent": "aren't", "cant": "can't", "couldve": "could've",
    "couldnt": "couldn't", "didnt": "didn't", "doesnt": "doesn't", "dont": "don't",
    "hadnt": "hadn't", "hasnt": "hasn't", "havent": "haven't", "hed": "he'd", "hes": "he's",
    "howd": "how'd", "howll": "how'll", "hows": "how's", "Im": "I'm", "im": "i'm",
    "Ive": "I've", "ive": "i've", "isnt": "isn't", "itd": "it'd", "itll": "it'll",
    "lets": "let's", "mightnt": "mightn't", "mightve": "might've", "mustnt": "mustn't",
    "mustve": "must've", "neednt": "needn't", "notve": "not've", "oclock": "o'clock",
    "shant": "shan't", "shed": "she'd", "shes": "she's", "shouldve": "should've",
    "shouldnt": "shouldn't", "somebodys": "somebody's", "someones": "someone's",
    "somethings": "something's", "thats": "that's", "thered": "there'd",
    "therere": "there're", "theres": "there's", "theyd": "they'd", "theyll": "they'll",
    "theyre": "they're", "theyve": "they've", "wasnt": "wasn't", "wed": "we'd",
    "weve": "we've", "werent": "weren't", "whatll": "what'll", "whatre": "what're",
    "whats": "what's", "whatve": "what've", "whens": "when's", "whered": "where'd",
    "wheres": "where's", "whereve": "where've", "whod": "who'd", "wholl": "who'll",
    "whos": "who's", "whove": "who've", "whyll": "why'll", "whyre": "why're",
    "whys": "why's", "wont": "won't", "wouldve": "would've", "wouldnt": "wouldn't",
    "yall": "y'all", "youd": "you'd", "youll": "you'll", "youre": "you're",
    "youve": "you've",
}  # fmt: skip


def process_punctuation(text: str) -> str:
    out = text
    for p in _PUNCT:
        if p + " " in text or " " + p in text or _COMMA_STRIP.search(text) is not None:
            out = out.replace(p, "")
        else:
            out = out.replace(p, " ")
    return _PERIOD_STRIP.sub("", out)


def process_digit_article(text: str) -> str:
    words = [_NUMBERS.get(w, w) for w in text.lower().split()]
    return " ".join(_CONTRACTIONS.get(w, w) for w in words if w not in _ARTICLES)


def normalize_answer(text: str) -> str:
    """An answer as VQA compares it (see the module docstring)."""
    text = text.replace("\n", " ").replace("\t", " ").strip()
    return process_digit_article(process_punctuation(text))


def vqa_accuracy(prediction: str, answers: Sequence[str]) -> float:
    """min(1, (normalised answers equal to the normalised prediction) / 3); one answer:
    exact match."""
    pred = normalize_answer(prediction)
    matches = sum(pred == normalize_answer(a) for a in answers)
    if len(answers) == 1:
        return float(matches)
    return min(1.0, matches / 3.0)
