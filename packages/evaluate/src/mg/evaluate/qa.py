"""Zero-shot short-answer QA (Natural Questions, TriviaQA style): greedy answers to
questions, scored by exact match and token F1 (`qa_metrics`).

A record is ``{"question": str, "answers": [str, ...]}`` with an optional
``"context"`` (a passage put before the question). The plain prompt is
``[context + "\\n"] + "Question: " + question + "\\nAnswer:"`` and the answer is the
greedy continuation up to its first line break or end of text. A model finetuned on
`mg-prep sft` conversations is asked in its own prompt format instead
(`--sft-tokenizer-prompt-format`): ``[context + "\\n\\n"] + question`` as one user
turn and the generation prompt, the ids a training conversation has before its
reply; the answer then also ends at the format's end of turn. A GPT runs the
whole sequence each step; a Retro model does too, with its chunks' neighbours
retrieved from the project's index as the text grows (`mg.core.retro.generation`).
A prompt longer than the model's positions keeps its last tokens.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mg.core.chat_format import ChatFormat
from mg.core.tokenizers.base import BaseTokenizer
from mg.evaluate.errors import EvalInputError, read_text
from mg.evaluate.qa_metrics import answer_of, exact_match, token_f1


@dataclass
class QARecord:
    question: str
    answers: list[str]
    context: str | None = None

    def prompt(self) -> str:
        head = f"{self.context}\n" if self.context else ""
        return f"{head}Question: {self.question}\nAnswer:"

    def messages(self) -> list[dict[str, str]]:
        """The question as a chat's one user turn, its context (if any) first."""
        head = f"{self.context}\n\n" if self.context else ""
        return [{"role": "user", "content": f"{head}{self.question}"}]


def read_records(path: str) -> list[QARecord]:
    records = []
    for number, line in enumerate(read_text(path, "qa").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise EvalInputError(f"not JSON ({exc.msg})", path, number) from None
        if not isinstance(row, dict) or not isinstance(row.get("question"), str):
            raise EvalInputError('no string field "question"', path, number)
        answers = row.get("answers")
        if isinstance(answers, str):
            answers = [answers]
        if (
            not isinstance(answers, list)
            or not answers
            or not all(isinstance(a, str) for a in answers)
        ):
            raise EvalInputError('"answers" must be a non-empty list of strings', path, number)
        context = row.get("context")
        if context is not None and not isinstance(context, str):
            raise EvalInputError('"context" must be a string', path, number)
        records.append(QARecord(row["question"], answers, context))
    return records


def stop_ids(tokenizer: BaseTokenizer) -> set[int]:
    """End of document, and the newline token where "\\n" is one token."""
    stops = {tokenizer.eod} if tokenizer.eod is not None else set()
    newline = tokenizer.tokenize("\n")
    if len(newline) == 1:
        stops.add(newline[0])
    return stops


def gpt_greedy(model: Any, limit: int) -> Callable[[list[int], int, set[int]], list[int]]:
    """Greedy generation with a GPT: the whole sequence each step, at most ``limit`` tokens."""
    device = next(model.parameters()).device

    @torch.inference_mode()
    def generate(prompt: list[int], max_new: int, stops: set[int]) -> list[int]:
        tokens, out = list(prompt), []
        while len(out) < max_new and len(tokens) < limit:
            logits = model(torch.tensor([tokens], device=device))
            token = int(logits[0, -1].argmax())
            tokens.append(token)
            out.append(token)
            if token in stops:
                break
        return out

    return generate


def evaluate_qa(
    records: Sequence[QARecord],
    tokenizer: BaseTokenizer,
    generate: Callable[[list[int], int, set[int]], list[int]],
    limit: int,
    max_new_tokens: int,
    chat: ChatFormat | None = None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(metrics, one row per record with its prediction and scores). With `chat`, each
    question is asked in that prompt format and the answer ends at its end of turn."""
    keep = limit - max_new_tokens
    if keep < 1:
        raise EvalInputError(
            f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in the model's "
            f"{limit} tokens"
        )
    stops = stop_ids(tokenizer)
    end_of_turn = ""
    if chat is not None:
        end_of_turn = chat.renderer.end_of_turn()
        end_id = chat.end_of_turn_id()
        if end_id is not None:
            stops.add(end_id)
    rows = []
    for record in records:
        if chat is None:
            prompt = tokenizer.tokenize(record.prompt())[-keep:]
        else:
            prompt = chat.prompt_ids(record.messages())[-keep:]
        generated = tokenizer.detokenize(generate(prompt, max_new_tokens, stops))
        if end_of_turn:
            generated = generated.split(end_of_turn, 1)[0]
        prediction = answer_of(generated)
        rows.append(
            {
                "question": record.question,
                "answers": record.answers,
                "prediction": prediction,
                "exact_match": exact_match(prediction, record.answers),
                "f1": token_f1(prediction, record.answers),
            }
        )
    n = len(rows)
    metrics = {
        "exact_match": sum(r["exact_match"] for r in rows) / n,
        "f1": sum(r["f1"] for r in rows) / n,
        "num_examples": n,
    }
    return metrics, rows
