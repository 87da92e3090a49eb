"""Perplexity and KL divergence on held-out indexed data, with core's model forward.

Perplexity is the same computation mg-eval's perplexity runs on a checkpoint:
exp(mean NLL over next-token predictions) on non-overlapping windows. Where recipes
move perplexity by less than it resolves, the mean KL divergence of the quantized
model's next-token distribution from the float model's (llama.cpp's
`--kl-divergence`) and how often both pick the same top token still separate them;
the float model's log-probabilities are kept in a temporary folder between the two
passes, a batch per file, so memory stays one batch of logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn


@torch.no_grad()
def perplexity(model: nn.Module, samples: Tensor, batch_size: int = 4) -> float:
    """samples [n, seq + 1]: each row predicts its tokens 1..seq from 0..seq-1."""
    total, count = 0.0, 0
    for batch in samples.split(batch_size):
        losses = model(batch[:, :-1], labels=batch[:, 1:])
        total += float(losses.double().sum())
        count += losses.numel()
    return math.exp(total / count)


@dataclass(frozen=True)
class Agreement:
    """How far a quantized model's next-token distributions moved from the float one's."""

    perplexity: float
    kl_divergence: float  # mean over predictions of KL(float || quantized), nats
    kl_divergence_p99: float
    same_top_token: float  # fraction of predictions whose argmax is unchanged


@torch.no_grad()
def reference_log_probs(
    model: nn.Module, samples: Tensor, folder: Path, batch_size: int = 4
) -> float:
    """The float model's perplexity; its log-probabilities go to `folder`, a batch a file."""
    total, count = 0.0, 0
    for k, batch in enumerate(samples.split(batch_size)):
        log_probs = _log_probs(model, batch[:, :-1])
        total -= float(_picked(log_probs, batch[:, 1:]).double().sum())
        count += batch[:, 1:].numel()
        torch.save(log_probs, folder / f"{k}.pt")
    return math.exp(total / count)


@torch.no_grad()
def agreement(model: nn.Module, samples: Tensor, folder: Path, batch_size: int = 4) -> Agreement:
    """Perplexity of `model` and its divergence from the log-probabilities in `folder`."""
    total, count, same = 0.0, 0, 0
    kls = []
    for k, batch in enumerate(samples.split(batch_size)):
        log_q = _log_probs(model, batch[:, :-1])
        log_p = torch.load(folder / f"{k}.pt")
        total -= float(_picked(log_q, batch[:, 1:]).double().sum())
        count += batch[:, 1:].numel()
        kls.append((log_p.exp() * (log_p - log_q)).sum(-1).flatten())
        same += int((log_p.argmax(-1) == log_q.argmax(-1)).sum())
    kl = torch.cat(kls).double()
    return Agreement(
        perplexity=math.exp(total / count),
        kl_divergence=float(kl.mean()),
        kl_divergence_p99=float(torch.quantile(kl, 0.99)),
        same_top_token=same / count,
    )


def _log_probs(model: nn.Module, tokens: Tensor) -> Tensor:
    return torch.log_softmax(model(tokens).float(), dim=-1)


def _picked(log_probs: Tensor, labels: Tensor) -> Tensor:
    return log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def state_bytes(model: nn.Module) -> int:
    """Bytes of the parameters and buffers a checkpoint of the model stores."""
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())
