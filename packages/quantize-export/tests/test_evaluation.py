"""Held-out perplexity and the KL divergence between a float and a quantized model,
checked on bigram models whose next-token distributions are written out by hand."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor, nn

from mg.quantize_export.evaluation import agreement, perplexity, reference_log_probs


class Bigram(nn.Module):
    """logits of the next token = a row of a table, picked by the current token."""

    def __init__(self, table: Tensor) -> None:
        super().__init__()
        self.table = nn.Parameter(table)

    def forward(self, tokens: Tensor, labels: Tensor | None = None) -> Tensor:
        logits = self.table[tokens]
        if labels is None:
            return logits
        return nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="none")


def test_kl_divergence_and_top_token_by_hand(tmp_path) -> None:
    p_table = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 3.0]])
    q_table = torch.tensor([[2.0, 0.0, 0.0], [1.5, 1.0, 0.0], [0.0, 0.0, 3.0]])
    samples = torch.tensor([[0, 1, 2, 1, 0], [1, 1, 2, 2, 0], [2, 0, 1, 1, 1]])
    ppl = reference_log_probs(Bigram(p_table), samples, tmp_path, batch_size=2)
    assert ppl == pytest.approx(perplexity(Bigram(p_table), samples, batch_size=2), rel=1e-6)
    moved = agreement(Bigram(q_table), samples, tmp_path, batch_size=2)

    def dist(row: list[float]) -> list[float]:
        z = sum(math.exp(v) for v in row)
        return [math.exp(v) / z for v in row]

    kls, same = [], 0
    for row in samples.tolist():
        for token in row[:-1]:
            p, q = dist(p_table[token].tolist()), dist(q_table[token].tolist())
            kls.append(sum(a * math.log(a / b) for a, b in zip(p, q, strict=True)))
            same += max(range(3), key=p.__getitem__) == max(range(3), key=q.__getitem__)
    # only token 1's row differs: KL > 0 there, and its top token moves from 1 to 0
    assert moved.kl_divergence == pytest.approx(sum(kls) / len(kls), rel=1e-5)
    assert moved.same_top_token == pytest.approx(same / len(kls))
    assert moved.same_top_token < 1
    assert moved.perplexity == pytest.approx(perplexity(Bigram(q_table), samples), rel=1e-6)
    itself = agreement(Bigram(p_table), samples, tmp_path, batch_size=2)
    assert itself.kl_divergence == pytest.approx(0, abs=1e-7) and itself.same_top_token == 1
