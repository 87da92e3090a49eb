"""GLUE MNLI and QQP TSV files, read as Megatron's ``tasks/glue/{mnli,qqp}.py`` reads them.

MNLI: a header row, then ``text_a = row[8]``, ``text_b = row[9]``, ``label = row[-1]``
(``contradiction`` 0, ``entailment`` 1, ``neutral`` 2); a header of 10 columns marks
the test file (no labels; every label is the test label). QQP: a header, then six
columns ``id qid1 qid2 question1 question2 is_duplicate`` (label ``row[5]``, 0/1), or
three columns ``id question1 question2`` for the test file; malformed rows and rows
with an empty question are skipped with a warning, as Megatron does.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from mg.core.tokenizers.base import BaseTokenizer
from mg.evaluate.errors import EvalInputError, read_text
from mg.evaluate.finetune_samples import (
    FinetuneSample,
    build_tokens_types_paddings_from_ids,
    clean_text,
)

MNLI_LABELS = {"contradiction": 0, "entailment": 1, "neutral": 2}
QQP_LABELS = (0, 1)


@dataclass(frozen=True)
class GlueTask:
    name: str
    num_classes: int


MNLI = GlueTask("MNLI", 3)
QQP = GlueTask("QQP", 2)


def _rows(path: str | Path, task: str) -> list[tuple[int, list[str]]]:
    text = read_text(path, task)
    first = text.lstrip()[:1]
    if first in "{[":
        raise EvalInputError(
            f"this looks like JSON, not a tab-separated GLUE file; {task} reads the GLUE "
            f"{task.upper()} .tsv (RACE json folders: `mg-eval race`)",
            path,
            1,
        )
    rows = []
    for number, line in enumerate(text.split("\n"), start=1):
        if line.strip():
            rows.append((number, line.strip().split("\t")))
    return rows


def read_mnli(
    path: str | Path, test_label: str = "contradiction"
) -> list[tuple[int, str, str, int]]:
    """``(uid, text_a, text_b, label)`` per row of an MNLI TSV file."""
    rows = _rows(path, "mnli")
    header_line, header = rows[0]
    if len(header) < 10:
        raise EvalInputError(
            f"the header has {len(header)} tab-separated columns; MNLI files have at least 10 "
            "(sentence1 is column 9, sentence2 column 10, the label the last)",
            path,
            header_line,
        )
    is_test = len(header) == 10
    out = []
    for number, row in rows[1:]:
        if len(row) < 10:
            raise EvalInputError(
                f"{len(row)} tab-separated columns, MNLI rows need at least 10", path, number
            )
        try:
            uid = int(row[0].strip())
        except ValueError:
            raise EvalInputError(
                f"column 1 (index) {row[0]!r} is not an integer", path, number
            ) from None
        text_a, text_b = clean_text(row[8].strip()), clean_text(row[9].strip())
        label = test_label if is_test else row[-1].strip()
        if not text_a or not text_b:
            raise EvalInputError("sentence1 or sentence2 (columns 9, 10) is empty", path, number)
        if label not in MNLI_LABELS:
            raise EvalInputError(
                f"label {label!r} (last column) is not one of {', '.join(MNLI_LABELS)}",
                path,
                number,
            )
        out.append((uid, text_a, text_b, MNLI_LABELS[label]))
    return out


def read_qqp(path: str | Path, test_label: int = 0) -> list[tuple[int, str, str, int]]:
    """``(uid, question1, question2, label)`` per usable row of a QQP TSV file."""
    rows = _rows(path, "qqp")
    header_line, header = rows[0]
    if len(header) not in (3, 6):
        raise EvalInputError(
            f"the header has {len(header)} tab-separated columns; QQP files have 6 "
            "(id qid1 qid2 question1 question2 is_duplicate) or 3 (test: id question1 question2)",
            path,
            header_line,
        )
    is_test = len(header) == 3
    out = []
    for number, row in rows[1:]:
        if is_test:
            if len(row) != 3:
                raise EvalInputError(f"expected 3 columns, got {len(row)}", path, number)
            uid_text, text_a, text_b, label_text = row[0], row[1], row[2], str(test_label)
        elif len(row) == 6:
            uid_text, text_a, text_b, label_text = row[0], row[3], row[4], row[5]
        else:
            print(f"WARNING: {path}:{number}: {len(row)} columns, skipping", file=sys.stderr)
            continue
        text_a, text_b = clean_text(text_a.strip()), clean_text(text_b.strip())
        if not text_a or not text_b:
            print(f"WARNING: {path}:{number}: an empty question, skipping", file=sys.stderr)
            continue
        try:
            uid, label = int(uid_text.strip()), int(label_text.strip())
        except ValueError:
            raise EvalInputError(
                f"id {uid_text!r} and is_duplicate {label_text!r} must be integers", path, number
            ) from None
        if label not in QQP_LABELS:
            raise EvalInputError(f"is_duplicate {label} is not 0 or 1", path, number)
        out.append((uid, text_a, text_b, label))
    return out


def glue_samples(
    task: GlueTask, paths: list[str], tokenizer: BaseTokenizer, seq_length: int
) -> list[FinetuneSample]:
    reader = read_mnli if task is MNLI else read_qqp
    samples = []
    for path in paths:
        for uid, text_a, text_b, label in reader(path):
            ids, types, paddings, trimmed = build_tokens_types_paddings_from_ids(
                tokenizer.tokenize(text_a),
                tokenizer.tokenize(text_b),
                seq_length,
                tokenizer.cls,
                tokenizer.sep,
                tokenizer.pad,
            )
            samples.append(FinetuneSample(uid, [ids], [types], [paddings], label, trimmed))
    if not samples:
        raise EvalInputError(f"{' '.join(paths)}: no {task.name} examples")
    return samples
