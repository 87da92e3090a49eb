"""Batched forward passes that return, per sequence, its summed loss and greedy correctness.

Every task reduces to this: a sequence of ``n + 1`` token ids and a 0/1 mask
over its ``n`` targets. Sequences in a batch are right-padded to the longest
one; with causal attention the padding cannot change the scored positions, so
results equal Megatron's fixed ``seq_length + 1`` padding.

Under torchrun each rank scores a strided share of the sequences and the scores
are gathered back in order, so every task's sums equal a one-process run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mg.evaluate import distributed
from mg.evaluate.progress import progress


@dataclass(frozen=True)
class Scored:
    tokens: Sequence[int]
    """``n + 1`` ids: inputs are ``tokens[:-1]``, targets ``tokens[1:]``."""
    mask: Sequence[int]
    """``n`` flags, 1 where the target counts."""


@dataclass
class SequenceScore:
    loss_sum: float
    """Sum of the cross-entropy (nats) over the masked targets."""
    num_targets: int
    all_correct: bool
    """Greedy argmax equals every masked target (LAMBADA's criterion)."""


@torch.no_grad()
def score_sequences(
    model: torch.nn.Module,
    items: Sequence[Scored],
    micro_batch_size: int,
    desc: str = "eval",
) -> list[SequenceScore]:
    model.eval()
    device = next(model.parameters()).device
    total = len(items)
    items = distributed.shard(items)
    batches = [items[i : i + micro_batch_size] for i in range(0, len(items), micro_batch_size)]
    out: list[SequenceScore] = []
    for batch in progress(batches, len(batches), desc):
        width = max(len(item.tokens) for item in batch)
        tokens = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width - 1, dtype=torch.bool)
        for row, item in enumerate(batch):
            tokens[row, : len(item.tokens)] = torch.as_tensor(item.tokens, dtype=torch.long)
            mask[row, : len(item.mask)] = torch.as_tensor(item.mask, dtype=torch.bool)
        tokens, mask = tokens.to(device), mask.to(device)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        logits = model(inputs).float()
        losses = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
        losses = losses.view(labels.shape).double() * mask
        correct = (logits.argmax(-1) == labels) | ~mask
        for row in range(len(batch)):
            out.append(
                SequenceScore(
                    loss_sum=float(losses[row].sum()),
                    num_targets=int(mask[row].sum()),
                    all_correct=bool(correct[row].all()),
                )
            )
    return distributed.unshard(out, total)
