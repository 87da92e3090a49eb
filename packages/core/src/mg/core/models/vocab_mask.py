"""The language-model output, where padded vocabulary rows take no probability.

Megatron pads the embedding and output layer to a multiple of
`--make-vocab-size-divisible-by` x TP rows (GPT-2's 50,257 tokens become 50,304).
No target is ever a padding row, but in a softmax those rows still take
probability mass, so a padded model's perplexity and samples differ slightly
from the unpadded model's (`transformers`'). A reader that knows the tokenizer
(mg-eval, mg-serve) sets the model's `real_vocab_size` (`unpadded_vocab_size`:
the imported model's own vocabulary, else the tokenizer's); the logits of the
rows beyond it are then -inf. Training keeps them, as Megatron's loss does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def mask_padded_vocab(logits: Tensor, real_vocab_size: int | None, vocab_start: int = 0) -> Tensor:
    """`logits` [..., n] of vocabulary rows vocab_start .. vocab_start + n - 1 (a
    tensor-parallel shard starts later), with the rows >= real_vocab_size at -inf."""
    if real_vocab_size is None or real_vocab_size - vocab_start >= logits.shape[-1]:
        return logits
    rows = torch.arange(logits.shape[-1], device=logits.device) + vocab_start
    return logits.masked_fill(rows >= real_vocab_size, float("-inf"))


def unpadded_vocab_size(config: Any, tokenizer_vocab_size: int) -> int:
    """Where Megatron's padding starts: a model imported from Hugging Face keeps its own
    vocabulary (`hf_vocab_size`, which may exceed the tokenizer's, as Qwen2's does);
    a model trained here was padded from its tokenizer's."""
    extra = getattr(config, "extra", None) or {}
    return int(extra.get("hf_vocab_size") or tokenizer_vocab_size)


def set_real_vocab_size(model: nn.Module, size: int | None) -> None:
    """Mask the padding rows beyond `size` in every output of `model` (whole, tensor-
    parallel or a pipeline stage); None unmasks."""
    for module in model.modules():
        if hasattr(module, "real_vocab_size"):
            module.real_vocab_size = size


def logits_or_loss(
    hidden: Tensor, weight: Tensor, labels: Tensor | None, real_vocab_size: int | None = None
) -> Tensor:
    """Final hidden states [b, s, h] → logits [b, s, vocab], or with labels the per-token
    cross-entropy [b, s] in fp32 (unreduced, as Megatron returns it)."""
    return loss_or_logits(mask_padded_vocab(F.linear(hidden, weight), real_vocab_size), labels)


def loss_or_logits(logits: Tensor, labels: Tensor | None) -> Tensor:
    """`logits` themselves, or with labels the per-token cross-entropy [b, s] in fp32."""
    if labels is None:
        return logits
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none").view(
        labels.shape
    )
