"""LAMBADA accuracy as Megatron computes it (``tasks/zeroshot_gpt``, REFERENCE §6).

Each line of the JSONL file is ``{"text": "... last word"}``. Default: the
target is the last token of the tokenized text. ``--strict-lambada``: the target
is the last whitespace word, tokenized with its leading space (often several
tokens); the context is the text before it, stripped. A line counts as correct
only when the greedy prediction matches every target token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mg.core.tokenizers.base import BaseTokenizer
from mg.evaluate.errors import EvalInputError, read_text
from mg.evaluate.scoring import Scored, score_sequences


@dataclass
class LambadaExample:
    line: int
    context: list[int]
    target: list[int]


@dataclass
class LambadaResult:
    num_correct: int
    num_examples: int
    accuracy: float
    strict: bool

    def metrics(self) -> dict[str, float | int | bool]:
        return dict(vars(self))


def read_lambada(path: str | Path) -> list[tuple[int, str]]:
    """``(line number, text)`` per non-blank line; each must be a JSON object with a ``text``."""
    content = read_text(path, "lambada")
    texts = []
    for number, line in enumerate(content.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise EvalInputError(
                f"not JSON ({exc.msg} at column {exc.colno}); lambada reads JSON lines "
                'like {"text": "..."} (for raw WikiText use `mg-eval wikitext`)',
                path,
                number,
            ) from None
        if not isinstance(record, dict) or "text" not in record:
            got = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise EvalInputError(f'no "text" field (got {got})', path, number)
        if not isinstance(record["text"], str) or not record["text"].strip():
            raise EvalInputError('"text" must be a non-empty string', path, number)
        texts.append((number, record["text"]))
    return texts


def split_example(tokenizer: BaseTokenizer, text: str, strict: bool) -> tuple[list[int], list[int]]:
    """Megatron's ``_LambadaDataset.get_tokens``: (context ids, target ids)."""
    if not strict:
        tokens = tokenizer.tokenize(text)
        return tokens[:-1], tokens[-1:]
    last_word = text.split()[-1]
    start = text.rfind(last_word)
    return tokenizer.tokenize(text[:start].strip()), tokenizer.tokenize(" " + last_word)


def build_examples(
    tokenizer: BaseTokenizer, path: str | Path, seq_length: int, strict: bool
) -> list[LambadaExample]:
    examples = []
    for number, text in read_lambada(path):
        context, target = split_example(tokenizer, text, strict)
        if not context or not target:
            raise EvalInputError(
                "no context before the target word; a LAMBADA line needs a passage and a last word",
                path,
                number,
            )
        if len(context) + len(target) > seq_length + 1:
            raise EvalInputError(
                f"context + target are {len(context)} + {len(target)} tokens, longer than "
                f"--seq-length {seq_length} + 1; shorten the passage or raise --seq-length "
                "(up to the model's max_position_embeddings)",
                path,
                number,
            )
        examples.append(LambadaExample(number, context, target))
    return examples


def evaluate_lambada(
    model,
    tokenizer: BaseTokenizer,
    path: str | Path,
    seq_length: int,
    micro_batch_size: int,
    strict: bool,
) -> LambadaResult:
    examples = build_examples(tokenizer, path, seq_length, strict)
    items = [
        # targets are tokens[1:]; the mask selects the target tokens only
        Scored(ex.context + ex.target, [0] * (len(ex.context) - 1) + [1] * len(ex.target))
        for ex in examples
    ]
    scores = score_sequences(model, items, micro_batch_size, desc="lambada")
    correct = sum(s.all_correct for s in scores)
    return LambadaResult(correct, len(examples), correct / len(examples), strict)
