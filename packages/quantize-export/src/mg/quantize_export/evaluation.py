"""Perplexity on held-out indexed data, with core's model forward (the per-token loss
GPTModel returns with labels), so the before/after numbers are the same computation
mg-eval's perplexity runs on a checkpoint: exp(mean NLL over next-token predictions)
on non-overlapping windows."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


@torch.no_grad()
def perplexity(model: nn.Module, samples: Tensor, batch_size: int = 4) -> float:
    """samples [n, seq + 1]: each row predicts its tokens 1..seq from 0..seq-1."""
    total, count = 0.0, 0
    for start in range(0, len(samples), batch_size):
        batch = samples[start : start + batch_size]
        losses = model(batch[:, :-1], labels=batch[:, 1:])
        total += float(losses.double().sum())
        count += losses.numel()
    return math.exp(total / count)


def state_bytes(model: nn.Module) -> int:
    """Bytes of the parameters and buffers a checkpoint of the model stores."""
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())
