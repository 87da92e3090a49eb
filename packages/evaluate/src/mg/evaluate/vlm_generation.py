"""Prompts in the training format, greedy answers and answer log-likelihoods of a LLaVAModel.

A prompt is rendered as `mg-train vlm` renders a conversation (its data module's
`render`): the image token where the text says `<image>`, each turn wrapped by the
prompt format, the turns before the answer only; then what the format puts before an
answer (chatml's `<|im_start|>assistant\\n`). The answer a model is scored on is the
text training put the loss on: raw `value`, mistral `" " + value`, chatml `value`.

A batch holds one image per row. Rows are padded at the end; the model is causal, so
the padding never changes the logits at a row's own positions, which are read at the
row's combined length (its text plus the image's rows). Greedy decoding recomputes the
whole sequence each step (no KV cache): the evaluation models are small and the answers
short; it stops at the end-of-document token (and chatml's `<|im_end|>`) or where the
next token would not fit the language model's sequence length.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from mg.core.models.vision import LLaVAModel
from mg.core.tokenizers.base import BaseTokenizer

IMAGE_TAG = "<image>"
IM_END = "<|im_end|>"


def _add(ids: list[int], text: str, tokenizer: BaseTokenizer, image_id: int) -> None:
    for i, piece in enumerate(text.split(IMAGE_TAG)):
        if i:
            ids.append(image_id)
        if piece:
            ids.extend(tokenizer.tokenize(piece))


def prompt_ids(
    turns: Sequence[dict[str, str]], tokenizer: BaseTokenizer, prompt_format: str, image_id: int
) -> list[int]:
    """The ids of `turns` (the conversation before the answer) and the answer's lead-in."""
    ids: list[int] = []
    for turn in turns:
        answer = turn["from"] == "gpt"
        if prompt_format == "chatml":
            role = {"human": "user", "gpt": "assistant"}.get(turn["from"], turn["from"])
            _add(ids, f"<|im_start|>{role}\n", tokenizer, image_id)
            _add(ids, turn["value"] + IM_END, tokenizer, image_id)
            _add(ids, "\n", tokenizer, image_id)
        elif prompt_format == "mistral":
            if answer:
                _add(ids, " " + turn["value"], tokenizer, image_id)
                ids.append(tokenizer.eod)
            else:
                _add(ids, f"[INST] {turn['value']}[/INST]", tokenizer, image_id)
        elif answer:
            _add(ids, turn["value"], tokenizer, image_id)
            ids.append(tokenizer.eod)
        else:
            _add(ids, turn["value"] + "\n", tokenizer, image_id)
    if prompt_format == "chatml":
        _add(ids, "<|im_start|>assistant\n", tokenizer, image_id)
    return ids


def answer_ids(answer: str, tokenizer: BaseTokenizer, prompt_format: str) -> list[int]:
    """The tokens training puts the loss on for `answer` (without the closing token)."""
    return tokenizer.tokenize(" " + answer if prompt_format == "mistral" else answer)


def answer_text(ids: Sequence[int], tokenizer: BaseTokenizer, prompt_format: str) -> str:
    """Generated ids → the answer's text (chatml's closer and what follows cut off)."""
    text = tokenizer.detokenize(list(ids)) if ids else ""
    if prompt_format == "chatml":
        text = text.split(IM_END)[0]
    return text.strip()


def combined_length(ids: Sequence[int], model: LLaVAModel) -> int:
    """Rows `ids` take in the language model's sequence (each image token expanded)."""
    config = model.config
    return len(ids) + (config.image_tokens - 1) * sum(i == config.image_token_index for i in ids)


def _padded(rows: Sequence[Sequence[int]], pad: int, device: torch.device) -> Tensor:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return ids.to(device)


@torch.no_grad()
def greedy_generate(
    model: LLaVAModel,
    images: Tensor,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    stop_ids: set[int],
    pad: int,
    stop_text: tuple[BaseTokenizer, str] | None = None,
) -> list[list[int]]:
    """Each row's greedy continuation of its prompt (one image each, `images` [b, 3, H, W])."""
    seq_length = model.config.language.seq_length
    outputs: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    for _ in range(max_new_tokens):
        rows = [list(p) + o for p, o in zip(prompts, outputs, strict=True)]
        logits = model(images, _padded(rows, pad, images.device))
        for i, row in enumerate(rows):
            length = combined_length(row, model)
            if done[i] or length > seq_length:
                done[i] = True
                continue
            token = int(logits[i, length - 1].argmax())
            if token in stop_ids:
                done[i] = True
                continue
            outputs[i].append(token)
            if stop_text is not None and stop_text[1] in stop_text[0].detokenize(outputs[i]):
                done[i] = True
        if all(done):
            break
    return outputs


@torch.no_grad()
def continuation_logprobs(
    model: LLaVAModel,
    images: Tensor,
    prompts: Sequence[Sequence[int]],
    continuations: Sequence[Sequence[int]],
    pad: int,
) -> list[float]:
    """Σ log p(continuation token | image, prompt, earlier tokens) for each row."""
    rows = [list(p) + list(c) for p, c in zip(prompts, continuations, strict=True)]
    logits = model(images, _padded(rows, pad, images.device))
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    scores = []
    for i, (prompt, cont) in enumerate(zip(prompts, continuations, strict=True)):
        start = combined_length(prompt, model) - 1  # the row that predicts the first token
        picked = logprobs[i, start : start + len(cont)].gather(
            -1, torch.tensor(cont, dtype=torch.long, device=logprobs.device).unsqueeze(-1)
        )
        scores.append(float(picked.sum()))
    return scores
