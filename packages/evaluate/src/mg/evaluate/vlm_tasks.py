"""`mg-eval captioning` and `mg-eval vqa`: a vision-language checkpoint's answers on
held-out image-text records, scored.

captioning  a greedy caption of each image (the record's prompt, as in training),
            scored against its references by CIDEr-D and BLEU-4 (caption_metrics)
vqa         short answer: the greedy answer, VQA accuracy against the annotators'
            answers (vqa_metrics); multiple choice: the choice with the highest
            log-likelihood as the answer, right or wrong

Every record's output goes to --output-path as a JSON line (Megatron's field names:
"caption"; "answer" and "gt_answer"), with its own score.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mg.core.models.vision.image_processing import BadImageError, open_rgb, preprocess
from mg.evaluate.caption_metrics import bleu4, cider_d
from mg.evaluate.errors import EvalInputError
from mg.evaluate.vlm_generation import (
    IM_END,
    answer_ids,
    answer_text,
    combined_length,
    continuation_logprobs,
    greedy_generate,
    prompt_ids,
)
from mg.evaluate.vlm_loading import LoadedVLM
from mg.evaluate.vlm_samples import VLMRecord
from mg.evaluate.vqa_metrics import vqa_accuracy


def _batches(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _images(vlm: LoadedVLM, records: Sequence[VLMRecord]) -> Tensor:
    """The records' images through the checkpoint's training transform, [b, 3, H, W]."""
    pixels = []
    for r in records:
        try:
            source = io.BytesIO(r.image) if isinstance(r.image, bytes) else r.image
            image = open_rgb(source, name=r.image_name)
            pixels.append(preprocess(image, vlm.transform))
        except BadImageError as exc:
            raise EvalInputError(f"image: {exc}", r.where) from None
    return torch.stack(pixels).to(vlm.device)


def _prompts(vlm: LoadedVLM, records: Sequence[VLMRecord]) -> list[list[int]]:
    image_id = vlm.config.image_token_index
    prompts = []
    for r in records:
        ids = prompt_ids(r.turns, vlm.tokenizer, vlm.prompt_format, image_id)
        if combined_length(ids, vlm.model) >= vlm.config.language.seq_length:
            raise EvalInputError(
                f"the prompt and its image take {combined_length(ids, vlm.model)} positions, "
                f"the model's --decoder-seq-length is {vlm.config.language.seq_length}; "
                "no room for an answer",
                r.where,
            )
        prompts.append(ids)
    return prompts


def _pad(vlm: LoadedVLM) -> int:
    pad = getattr(vlm.tokenizer, "pad", None)
    return vlm.tokenizer.eod if pad is None or pad < 0 else pad


def generate_answers(
    vlm: LoadedVLM, records: Sequence[VLMRecord], batch: int, max_new_tokens: int
) -> list[str]:
    """Each record's greedy answer to its prompt, as text."""
    tokenizer, fmt = vlm.tokenizer, vlm.prompt_format
    stop_text = (tokenizer, IM_END) if fmt == "chatml" else None
    texts = []
    for chunk in _batches(records, batch):
        prompts = _prompts(vlm, chunk)
        ids = greedy_generate(
            vlm.model, _images(vlm, chunk), prompts, max_new_tokens,
            {tokenizer.eod}, _pad(vlm), stop_text,
        )  # fmt: skip
        texts += [answer_text(row, tokenizer, fmt) for row in ids]
    return texts


def choose_options(
    vlm: LoadedVLM, records: Sequence[VLMRecord], batch: int
) -> list[tuple[int, list[float]]]:
    """(the chosen index, each choice's log-likelihood) of each multiple-choice record."""
    rows = [(r, i) for r in records for i in range(len(r.choices or []))]
    scores: dict[int, list[float]] = {}
    for chunk in _batches(rows, batch):
        recs = [r for r, _ in chunk]
        conts = [answer_ids(r.choices[i], vlm.tokenizer, vlm.prompt_format) for r, i in chunk]
        prompts = _prompts(vlm, recs)
        too_long = [
            r for r, p, c in zip(recs, prompts, conts, strict=True)
            if combined_length(p, vlm.model) + len(c) > vlm.config.language.seq_length
        ]  # fmt: skip
        if too_long:
            raise EvalInputError(
                "the prompt and a choice do not fit the model's --decoder-seq-length "
                f"({vlm.config.language.seq_length})",
                too_long[0].where,
            )
        logps = continuation_logprobs(vlm.model, _images(vlm, recs), prompts, conts, _pad(vlm))
        for r, logp in zip(recs, logps, strict=True):
            scores.setdefault(r.line, []).append(logp)
    return [
        (max(range(len(scores[r.line])), key=scores[r.line].__getitem__), scores[r.line])
        for r in records
    ]


def _write_jsonl(path: str | Path, rows: list[dict[str, Any]]) -> None:
    tmp = f"{path}.tmp"
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(tmp, "w", encoding="utf-8") as out:
        for row in rows:
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def evaluate_captioning(
    vlm: LoadedVLM,
    records: Sequence[VLMRecord],
    batch: int,
    max_new_tokens: int,
    output_path: str | Path | None,
) -> dict[str, Any]:
    captions = generate_answers(vlm, records, batch, max_new_tokens)
    references = [r.references for r in records]
    cider, per_image = cider_d(captions, references)
    bleu = bleu4(captions, references)
    if output_path:
        _write_jsonl(output_path, [
            {"sample_id": r.sample_id, "image": r.image_name, "caption": c,
             "references": r.references, "cider": s}
            for r, c, s in zip(records, captions, per_image, strict=True)
        ])  # fmt: skip
    return {"cider": cider, "bleu4": bleu, "num_examples": len(records)}


def evaluate_vqa(
    vlm: LoadedVLM,
    records: Sequence[VLMRecord],
    batch: int,
    max_new_tokens: int,
    output_path: str | Path | None,
) -> dict[str, Any]:
    short = [r for r in records if r.choices is None]
    multi = [r for r in records if r.choices is not None]
    generated = generate_answers(vlm, short, batch, max_new_tokens)
    answers = dict(zip((r.line for r in short), generated, strict=True))
    chosen = dict(zip((r.line for r in multi), choose_options(vlm, multi, batch), strict=True))
    rows, short_acc, multi_acc = [], [], []
    for r in records:
        row: dict[str, Any] = {"sample_id": r.sample_id, "image": r.image_name,
                               "question": r.question}  # fmt: skip
        if r.choices is None:
            acc = vqa_accuracy(answers[r.line], r.references)
            short_acc.append(acc)
            row.update(answer=answers[r.line], gt_answer=r.references)
        else:
            index, logps = chosen[r.line]
            acc = float(index == r.answer_index)
            multi_acc.append(acc)
            row.update(
                answer=r.choices[index], gt_answer=[r.choices[r.answer_index]],
                choices=r.choices, choice_logprobs=logps,
            )  # fmt: skip
        rows.append(dict(row, accuracy=acc))
    if output_path:
        _write_jsonl(output_path, rows)
    every = short_acc + multi_acc
    return {
        "accuracy": sum(every) / len(every),
        "num_examples": len(every),
        "short_answer_accuracy": sum(short_acc) / len(short_acc) if short_acc else None,
        "short_answer_examples": len(short_acc),
        "multiple_choice_accuracy": sum(multi_acc) / len(multi_acc) if multi_acc else None,
        "multiple_choice_examples": len(multi_acc),
    }
