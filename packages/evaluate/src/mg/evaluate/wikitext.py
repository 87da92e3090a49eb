"""WikiText perplexity as Megatron computes it (``tasks/zeroshot_gpt``, REFERENCE §6).

The whole file is one text: words are counted on the raw WikiText, the text is
detokenized and tokenized at once, and scored in windows of ``seq_length + 1``
tokens that advance by ``stride`` (``--overlapping-eval``). Window 0 scores all
its targets; every later window only its last ``stride`` targets, so each
token is predicted once, with at least ``seq_length - stride`` tokens of context.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from mg.core.tokenizers.base import BaseTokenizer
from mg.evaluate.detokenizer import wikitext_detokenize
from mg.evaluate.errors import EvalInputError, read_text
from mg.evaluate.scoring import Scored, score_sequences


@dataclass
class WikiTextResult:
    avg_loss: float
    ppl: float
    adjusted_ppl: float
    token_ratio: float
    num_tokenized_tokens: int
    num_original_tokens: int
    num_windows: int

    def metrics(self) -> dict[str, float | int]:
        return dict(vars(self))


def read_wikitext(path: str | Path) -> str:
    """The raw file; JSON (a LAMBADA file, a corpus .jsonl) is refused, WikiText is plain text."""
    text = read_text(path, "wikitext")
    first = text.lstrip()
    if first[:1] in "{[":
        line = text[: len(text) - len(first)].count("\n") + 1
        first_line = first.split("\n", 1)[0]
        try:
            json.loads(first_line)
        except json.JSONDecodeError:
            pass
        else:
            raise EvalInputError(
                "this looks like JSON lines, not WikiText; wikitext reads the raw "
                "wiki.test.tokens / wiki.valid.tokens file (LAMBADA .jsonl: `mg-eval lambada`)",
                path,
                line,
            )
    return text


def count_original_words(text: str) -> int:
    """Megatron's word count: ``len(text.strip().split(" "))`` on the raw WikiText."""
    return len(text.strip().split(" "))


def build_windows(tokens: list[int], seq_length: int, stride: int) -> list[Scored]:
    """Megatron's ``_LMDataset``: ``max(ceil((T - stride) / stride) + 1, 1)`` windows, T targets."""
    total_targets = len(tokens) - 1
    num_windows = max(math.ceil(max(total_targets - stride, 0) / stride) + 1, 1)
    windows = []
    for idx in range(num_windows):
        start = idx * stride
        window = tokens[start : start + seq_length + 1]
        mask = [1] * (len(window) - 1)
        if idx != 0 and stride != seq_length:
            # only the last `stride` positions of the full seq_length window count
            for pos in range(min(seq_length - stride, len(mask))):
                mask[pos] = 0
        windows.append(Scored(window, mask))
    return windows


def evaluate_wikitext(
    model,
    tokenizer: BaseTokenizer,
    path: str | Path,
    seq_length: int,
    stride: int,
    micro_batch_size: int,
) -> WikiTextResult:
    if not 1 <= stride <= seq_length:
        raise EvalInputError(
            f"--overlapping-eval {stride} must be between 1 and --seq-length {seq_length}"
        )
    raw = read_wikitext(path)
    num_words = count_original_words(raw)
    tokens = tokenizer.tokenize(wikitext_detokenize(raw))
    if len(tokens) < 2 or num_words < 2:
        raise EvalInputError(
            f"{len(tokens)} tokens / {num_words} words: perplexity needs at least 2 of each",
            path,
        )
    windows = build_windows(tokens, seq_length, stride)
    scores = score_sequences(model, windows, micro_batch_size, desc="wikitext")
    total = sum(s.loss_sum for s in scores)
    n_tok = len(tokens)
    avg = total / (n_tok - 1)
    token_ratio = (n_tok - 1) / (num_words - 1)
    return WikiTextResult(
        avg_loss=avg,
        ppl=math.exp(min(20.0, avg)),
        adjusted_ppl=math.exp(min(20.0, avg * token_ratio)),
        token_ratio=token_ratio,
        num_tokenized_tokens=n_tok,
        num_original_tokens=num_words,
        num_windows=len(windows),
    )
