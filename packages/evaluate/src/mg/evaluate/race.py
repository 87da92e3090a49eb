"""RACE folders, read as Megatron's ``tasks/race/data.py`` reads them.

A data path is a folder of ``*.txt`` files (the RACE release: ``RACE/train/middle``,
``RACE/dev/high``, ...), each line one JSON object with ``article``, ``questions``,
``options`` (4 per question) and ``answers`` (``"A"``..``"D"``). Every question gives
four rows ``[CLS] question/choice [SEP] article [SEP]``: a ``_`` in the question is
replaced by the choice, otherwise the choice is appended; the question+choice is cut
to 128 tokens. The label is the index of the right choice.
"""

from __future__ import annotations

import json
from pathlib import Path

from mg.core.tokenizers.base import BaseTokenizer
from mg.evaluate.errors import EvalInputError, read_text
from mg.evaluate.finetune_samples import (
    FinetuneSample,
    build_tokens_types_paddings_from_ids,
    clean_text,
)

NUM_CHOICES = 4
MAX_QA_LENGTH = 128
_FIELDS = ("article", "questions", "options", "answers")


def race_files(datapath: str | Path) -> list[Path]:
    """The ``*.txt`` files of a RACE folder (sorted), or the file itself."""
    path = Path(datapath)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise EvalInputError("no such RACE folder (a folder of *.txt JSON files)", path)
    files = sorted(path.glob("*.txt"))
    if not files:
        raise EvalInputError("no *.txt files; a RACE folder holds one JSON document per file", path)
    return files


def _record(line: str, path: Path, number: int) -> dict:
    try:
        data = json.loads(line)
    except json.JSONDecodeError as exc:
        raise EvalInputError(
            f"not JSON ({exc.msg} at column {exc.colno}); RACE files hold JSON objects with "
            f"{', '.join(_FIELDS)} (GLUE .tsv: `mg-eval mnli`/`qqp`)",
            path,
            number,
        ) from None
    missing = [f for f in _FIELDS if not isinstance(data, dict) or f not in data]
    if missing:
        raise EvalInputError(f"missing field(s) {', '.join(missing)}", path, number)
    n = len(data["questions"])
    if len(data["answers"]) != n or len(data["options"]) != n:
        raise EvalInputError(
            f"{n} questions but {len(data['answers'])} answers and {len(data['options'])} "
            "option lists",
            path,
            number,
        )
    return data


def race_samples(
    datapaths: list[str], tokenizer: BaseTokenizer, seq_length: int
) -> list[FinetuneSample]:
    samples: list[FinetuneSample] = []
    for datapath in datapaths:
        for path in race_files(datapath):
            for number, line in enumerate(read_text(path, "race").split("\n"), start=1):
                if not line.strip():
                    continue
                data = _record(line, path, number)
                context_ids = tokenizer.tokenize(clean_text(data["article"]))
                for qi, question in enumerate(data["questions"]):
                    answer = data["answers"][qi]
                    label = ord(answer) - ord("A") if isinstance(answer, str) and answer else -1
                    if not 0 <= label < NUM_CHOICES:
                        raise EvalInputError(
                            f"question {qi + 1}: answer {answer!r} is not one of A, B, C, D",
                            path,
                            number,
                        )
                    choices = data["options"][qi]
                    if len(choices) != NUM_CHOICES:
                        raise EvalInputError(
                            f"question {qi + 1} has {len(choices)} options; RACE has 4",
                            path,
                            number,
                        )
                    rows: tuple[list, list, list] = ([], [], [])
                    trimmed = False
                    for choice in choices:
                        qa = (
                            question.replace("_", choice)
                            if "_" in question
                            else f"{question} {choice}"
                        )
                        qa_ids = tokenizer.tokenize(clean_text(qa))[:MAX_QA_LENGTH]
                        ids, types, paddings, cut = build_tokens_types_paddings_from_ids(
                            qa_ids,
                            context_ids,
                            seq_length,
                            tokenizer.cls,
                            tokenizer.sep,
                            tokenizer.pad,
                        )
                        trimmed |= cut
                        for store, row in zip(rows, (ids, types, paddings), strict=True):
                            store.append(row)
                    samples.append(FinetuneSample(len(samples), *rows, label, trimmed))
    if not samples:
        raise EvalInputError(f"{' '.join(datapaths)}: no RACE questions")
    return samples
