"""An independent computation with transformers: the same weights as a GPT2LMHeadModel,
and plain loops written from REFERENCE §6 (no mg.evaluate code)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from mg.core.models.hf_mapping import config_to_hf, megatron_to_hf

GPT2_VOCAB = 50257  # the GPT-2 BPE tokenizer's


def to_hf(model, vocab_size: int = GPT2_VOCAB) -> GPT2LMHeadModel:
    """The model as `transformers` holds it, without Megatron's padding rows beyond the
    tokenizer's `vocab_size` (mg-eval gives them no probability, as if absent)."""
    hf_config = GPT2Config(**{**config_to_hf(model.config, "gpt2"), "vocab_size": vocab_size})
    hf = GPT2LMHeadModel(hf_config)
    weights = megatron_to_hf(model.state_dict(), model.config, "gpt2")
    weights["transformer.wte.weight"] = weights["transformer.wte.weight"][:vocab_size]
    missing, unexpected = hf.load_state_dict(weights, strict=False)
    assert not unexpected
    assert all(k == "lm_head.weight" or k.endswith("attn.bias") for k in missing), missing
    hf.tie_weights()
    return hf.eval()


@torch.no_grad()
def log_probs(hf: GPT2LMHeadModel, ids: list[int]) -> torch.Tensor:
    logits = hf(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, -1)


def wikitext_ppl(hf, tokenizer, raw: str, seq_length: int, stride: int) -> dict[str, float]:
    """Sliding-window loss: each target is scored once, in the first window that
    reaches it after the previous windows' targets (HF's perplexity recipe)."""
    words = len(raw.strip().split(" "))
    ids = tokenizer.tokenize(_megatron_detok(raw))
    total, scored_upto, start = 0.0, 0, 0
    while scored_upto < len(ids) - 1:
        window = ids[start : start + seq_length + 1]
        lp = log_probs(hf, window[:-1])
        for j in range(len(window) - 1):
            if start + j + 1 > scored_upto:
                total -= float(lp[j, window[j + 1]])
        scored_upto = start + len(window) - 1
        start += stride
    avg = total / (len(ids) - 1)
    ratio = (len(ids) - 1) / (words - 1)
    return dict(
        avg_loss=avg,
        ppl=math.exp(min(20, avg)),
        adjusted_ppl=math.exp(min(20, avg * ratio)),
        token_ratio=ratio,
    )


def _megatron_detok(raw: str) -> str:
    from mg.evaluate.detokenizer import wikitext_detokenize  # tested on its own, by hand

    return wikitext_detokenize(raw)


def lambada_correct(hf, tokenizer, path, strict: bool) -> list[bool]:
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        text = json.loads(line)["text"]
        if strict:
            word = re.split(r"\s+", text.strip())[-1]
            context = tokenizer.tokenize(text[: text.rfind(word)].strip())
            target = tokenizer.tokenize(" " + word)
        else:
            ids = tokenizer.tokenize(text)
            context, target = ids[:-1], ids[-1:]
        lp = log_probs(hf, context + target[:-1])
        predicted = lp[len(context) - 1 :].argmax(-1).tolist()
        out.append(predicted == target)
    return out
