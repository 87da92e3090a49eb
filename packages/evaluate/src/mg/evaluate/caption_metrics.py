"""Captioning scores: CIDEr-D and BLEU-4 of candidate captions against their references.

Megatron scores COCO captions with `pycocoevalcap` (examples/multimodal/evaluation/
evaluate_coco.py). That package is not a dependency here: its tokenizer runs Stanford's
PTBTokenizer as a Java subprocess, and the wheel bundles the METEOR and SPICE jars
(hundreds of MB) that captioning CIDEr and BLEU do not need. Both scores are written
out below from their papers, computed as `pycocoevalcap` computes them:

CIDEr-D (Vedantam et al., 2015, "CIDEr: Consensus-based Image Description Evaluation",
section 4 and the CIDEr-D variant): for n = 1..4 each caption is a vector of n-gram
TF-IDF weights, tf · (log |I| - log max(1, df)), where |I| is the number of images
scored and df the number of images whose references contain the n-gram. Per image
and n, the similarity to each reference is Σ min(g_c, g_r) · g_r / (‖g_c‖ ‖g_r‖)
(the candidate's counts clipped to the reference's) times exp(-(l_c - l_r)² / 2σ²),
σ = 6, l the captions' lengths. CIDEr-D of an image = 10 · the mean over n of the mean
over its references; of the set, the mean over images. (With one image log |I| = 0
and every weight is 0: CIDEr needs a set of images.)

BLEU-4 (Papineni et al., 2002): corpus-level clipped n-gram precisions p1..p4, their
geometric mean times the brevity penalty exp(1 - r/c) when the candidates' total
length c is below r, the sum of each candidate's closest reference length (ties: the
shorter). A precision of 0 gives 0 (no smoothing).

Captions are tokenized as the COCO evaluation's PTB step leaves them: lower case,
punctuation split off and dropped (hyphens inside words kept), split on white space.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence

MAX_N = 4
CIDER_SIGMA = 6.0

_PUNCT = re.compile(r"""[.,?!:;"()\[\]{}`]|'(?!\w)|(?<!\w)'|(?<!\w)-+|-+(?!\w)""")


def caption_tokens(text: str) -> list[str]:
    """Lower-cased words without punctuation (PTBTokenizer's output, as COCO scores it)."""
    return _PUNCT.sub(" ", text.lower()).split()


def ngrams(words: Sequence[str], n_max: int = MAX_N) -> Counter[tuple[str, ...]]:
    """Counts of every 1..n_max-gram of `words`."""
    return Counter(
        tuple(words[i : i + n]) for n in range(1, n_max + 1) for i in range(len(words) - n + 1)
    )


def bleu4(candidates: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """Corpus BLEU-4 in [0, 1] of `candidates[i]` against `references[i]` (one or more)."""
    matches, totals = [0] * MAX_N, [0] * MAX_N
    cand_len = ref_len = 0
    for cand, refs in zip(candidates, references, strict=True):
        words = caption_tokens(cand)
        ref_words = [caption_tokens(r) for r in refs]
        counts = ngrams(words)
        most: Counter[tuple[str, ...]] = Counter()
        for r in ref_words:
            most |= ngrams(r)  # the most times any one reference holds each n-gram
        for gram, count in counts.items():
            matches[len(gram) - 1] += min(count, most[gram])
        for n in range(1, MAX_N + 1):
            totals[n - 1] += max(0, len(words) - n + 1)
        cand_len += len(words)
        ref_len += min((abs(len(r) - len(words)), len(r)) for r in ref_words)[1]
    if min(matches) == 0:
        return 0.0
    log_precision = sum(math.log(m / t) for m, t in zip(matches, totals, strict=True)) / MAX_N
    brevity = 0.0 if cand_len >= ref_len else 1.0 - ref_len / cand_len
    return math.exp(log_precision + brevity)


def cider_d(
    candidates: Sequence[str], references: Sequence[Sequence[str]]
) -> tuple[float, list[float]]:
    """(CIDEr-D of the set, each image's) of `candidates[i]` against `references[i]`."""
    cands = [ngrams(caption_tokens(c)) for c in candidates]
    refs = [[ngrams(caption_tokens(r)) for r in rs] for rs in references]
    if len(cands) != len(refs):
        raise ValueError(f"{len(cands)} candidates but {len(refs)} reference sets")
    df: Counter[tuple[str, ...]] = Counter()
    for rs in refs:
        df.update(set().union(*rs))
    log_images = math.log(len(cands)) if cands else 0.0

    def vector(counts: Counter) -> tuple[list[dict], list[float], int]:
        vec: list[dict] = [{} for _ in range(MAX_N)]
        for gram, tf in counts.items():
            vec[len(gram) - 1][gram] = tf * (log_images - math.log(max(1.0, df[gram])))
        norms = [math.sqrt(sum(w * w for w in v.values())) for v in vec]
        length = sum(tf for gram, tf in counts.items() if len(gram) == 1)
        return vec, norms, length

    scores = []
    for cand, rs in zip(cands, refs, strict=True):
        c_vec, c_norm, c_len = vector(cand)
        total = [0.0] * MAX_N
        for r in rs:
            r_vec, r_norm, r_len = vector(r)
            penalty = math.exp(-((c_len - r_len) ** 2) / (2 * CIDER_SIGMA**2))
            for n in range(MAX_N):
                dot = sum(
                    min(w, r_vec[n].get(g, 0.0)) * r_vec[n].get(g, 0.0) for g, w in c_vec[n].items()
                )
                if c_norm[n] and r_norm[n]:
                    total[n] += dot / (c_norm[n] * r_norm[n]) * penalty
        scores.append(10.0 * sum(total) / MAX_N / max(1, len(rs)))
    return (sum(scores) / len(scores) if scores else 0.0), scores
