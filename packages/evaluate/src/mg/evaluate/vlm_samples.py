"""Held-out image-text records for `mg-eval captioning` and `mg-eval vqa` (JSON lines).

The records are LLaVA's, as `mg-prep vlm` reads them, one JSON object a line:

    captioning  {"image": "path", "text" | "caption": "..."}, or "captions": [...] (several
                references), or "conversations": [..., {"from": "gpt", "value": ref}]
                (the last turn is the reference, the turns before it the prompt)
    vqa         {"image": "path", "question": "...", "answer": "..." | "answers": [...],
                 "choices": [...] (optional: multiple choice; the answer is a choice's
                 text, its letter A, B, ... or its 0-based index)}

An optional "sample_id" (or "question_id") names the record in the outputs; by default
its line number. Image paths are relative to --input-image-path, else to the file's
folder. Every record is checked (fields, image file present) before a model is loaded,
and a bad one is named by file, line and field.
"""

from __future__ import annotations

import json
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mg.core.energon_split import split_shards
from mg.evaluate.errors import EvalInputError, read_text

IMAGE_TAG = "<image>"


@dataclass
class VLMRecord:
    line: int
    """The record's line (its place in the shards for a dataset folder); a key."""
    sample_id: Any
    image_name: str
    image: Path | bytes
    """The image file, or its bytes (a sample of an `mg-prep vlm` folder)."""
    turns: list[dict[str, str]]
    """The prompt: the conversation before the answer, with one `<image>` tag."""
    references: list[str]
    """Reference captions, or the annotators' answers."""
    question: str | None = None
    choices: list[str] | None = None
    answer_index: int | None = None
    """Multiple choice: the index of the right choice."""
    where: str = ""
    """`FILE:LINE` (or `SHARD:KEY`) for messages."""


def _strings(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, str) for v in value)


def _with_image_tag(turns: list[dict[str, str]]) -> list[dict[str, str]]:
    """LLaVA puts the image before the first question when no turn says where."""
    tags = sum(t["value"].count(IMAGE_TAG) for t in turns)
    if tags > 1:
        raise ValueError(f"conversations: {tags} {IMAGE_TAG} tags for one image")
    if tags == 0:
        first = next((i for i, t in enumerate(turns) if t["from"] != "system"), None)
        if first is None:
            raise ValueError("conversations: no human turn before the answer")
        turns[first] = {**turns[first], "value": f"{IMAGE_TAG}\n{turns[first]['value']}"}
    return turns


def _caption_parts(record: dict[str, Any]) -> tuple[list[dict[str, str]], list[str]]:
    if "conversations" in record:
        turns = record["conversations"]
        if not isinstance(turns, list) or len(turns) < 2:
            raise ValueError("conversations: not a list of at least two turns")
        for turn in turns:
            if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
                raise ValueError('conversations: each turn needs {"from", "value"}')
            if turn.get("from") not in ("human", "gpt", "system"):
                raise ValueError(f"conversations: unknown speaker {turn.get('from')!r}")
        if turns[-1]["from"] != "gpt":
            raise ValueError("conversations: the last turn (the reference) is not from gpt")
        prompt = [{"from": t["from"], "value": t["value"]} for t in turns[:-1]]
        return prompt, [turns[-1]["value"]]
    if "captions" in record:
        refs = record["captions"]
        if not _strings(refs):
            raise ValueError("captions: not a non-empty list of strings")
    else:
        text = record.get("text", record.get("caption"))
        if not isinstance(text, str) or not text.strip():
            raise ValueError('no "conversations", "captions", "text" or "caption" field')
        refs = [text]
    return [{"from": "human", "value": IMAGE_TAG}], list(refs)


def _vqa_parts(record: dict[str, Any]) -> tuple[str, list[str], list[str] | None, int | None]:
    question = record.get("question")
    if not isinstance(question, str) or not question.strip():
        raise ValueError('no "question" field (a non-empty string)')
    if "answers" in record:
        answers = record["answers"]
        if not _strings(answers):
            raise ValueError("answers: not a non-empty list of strings")
    elif isinstance(record.get("answer"), str | int) and not isinstance(record["answer"], bool):
        answers = [str(record["answer"])]
    else:
        raise ValueError('no "answer" (a string) or "answers" (a list of strings) field')
    choices = record.get("choices")
    if choices is None:
        return question, list(answers), None, None
    if not _strings(choices) or len(choices) < 2:
        raise ValueError("choices: not a list of at least two strings")
    given = record.get("answer", answers[0])
    return question, [str(given)], list(choices), _choice_index(given, choices)


def _choice_index(answer: Any, choices: list[str]) -> int:
    if isinstance(answer, int) and not isinstance(answer, bool) and 0 <= answer < len(choices):
        return answer
    text = str(answer).strip()
    if text in choices:
        return choices.index(text)
    letter = text.rstrip(".)").upper()
    if len(letter) == 1 and 0 <= ord(letter) - ord("A") < len(choices):
        return ord(letter) - ord("A")
    raise ValueError(f"answer: {answer!r} is not one of the choices, their letter or index")


def read_records(
    path: str | Path, task: str, image_folder: str | Path | None, split: str = "test"
) -> list[VLMRecord]:
    """The file's records (or the `split` of an `mg-prep vlm` folder), each checked;
    EvalInputError names the first bad one."""
    path = Path(path)
    if path.is_dir():
        return read_shard_records(path, split)
    root = Path(image_folder) if image_folder else path.parent
    if image_folder and not root.is_dir():
        raise EvalInputError("no such folder (--input-image-path)", root)
    records = []
    for number, line in enumerate(read_text(path, task).splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise EvalInputError(f"not JSON ({exc.msg})", path, number) from None
        if not isinstance(record, dict):
            raise EvalInputError("not a JSON object", path, number)
        name = record.get("image")
        if not isinstance(name, str) or not name:
            raise EvalInputError('no "image" field (the image file\'s path)', path, number)
        image = root / name
        if not image.is_file():
            raise EvalInputError(f"image: no such file {image}", path, number)
        sample_id = record.get("sample_id", record.get("question_id", number))
        try:
            if task == "captioning":
                turns, refs = _caption_parts(record)
                item = VLMRecord(number, sample_id, name, image, _with_image_tag(turns), refs)
                item.where = f"{path}:{number}"
            else:
                question, answers, choices, index = _vqa_parts(record)
                turns = [{"from": "human", "value": question}]
                item = VLMRecord(
                    number, sample_id, name, image, _with_image_tag(turns), answers,
                    question, choices, index, f"{path}:{number}",
                )  # fmt: skip
        except ValueError as exc:
            raise EvalInputError(str(exc), path, number) from None
        records.append(item)
    if not records:
        raise EvalInputError(f"no records; {task} has nothing to evaluate", path)
    return records


def read_shard_records(folder: Path, split: str) -> list[VLMRecord]:
    """The `split` of an `mg-prep vlm` folder (energon's WebDataset layout: `.nv-meta/
    split.yaml`, tars of KEY.png|jpg + KEY.json {"conversations"}). Each sample's last
    `gpt` turn is its reference (a caption, or a short answer), the turns before it the
    prompt; the image stays as its bytes."""
    shards = split_shards(folder, split)
    if shards is None:
        raise EvalInputError(
            "a folder but no .nv-meta/split.yaml; give a JSON-lines file or an mg-prep vlm "
            "dataset (--valid-data)",
            folder,
        )
    records = []
    for shard in shards:
        try:
            with tarfile.open(shard) as tar:
                parts: dict[str, dict[str, bytes]] = {}
                for member in tar:
                    if member.isfile():
                        key, _, ext = member.name.partition(".")
                        parts.setdefault(key, {})[ext] = tar.extractfile(member).read()
        except (OSError, tarfile.TarError) as exc:
            raise EvalInputError(f"cannot read the shard ({exc})", shard) from None
        for key, part in parts.items():
            where = f"{shard}:{key}"
            image = part.get("jpg") or part.get("png")
            if image is None or "json" not in part:
                raise EvalInputError("no image or no .json part", where)
            try:
                sample = json.loads(part["json"])
                turns, refs = _caption_parts({"conversations": sample.get("conversations")})
                turns = _with_image_tag(turns)
            except (ValueError, AttributeError) as exc:
                raise EvalInputError(str(exc), where) from None
            name_in = sample.get("image", key) if isinstance(sample, dict) else key
            records.append(
                VLMRecord(
                    len(records) + 1,
                    key,
                    str(name_in),
                    image,
                    turns,
                    refs,
                    question=turns[-1]["value"],
                    where=where,
                )  # fmt: skip
            )
    if not records:
        raise EvalInputError(f"the {split} split has no samples (--eval-split)", folder)
    return records
