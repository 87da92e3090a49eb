"""Batched forward passes that return, per sequence, its summed loss and greedy correctness.

Every task reduces to this: a sequence of ``n + 1`` token ids and a 0/1 mask
over its ``n`` targets. Sequences in a batch are right-padded to the longest
one; with causal attention the padding cannot change the scored positions, so
results equal Megatron's fixed ``seq_length + 1`` padding.

Under torchrun each data-parallel rank scores a strided share of the sequences
and the scores are gathered back in order, so every task's sums equal a
one-process run; in a tensor/pipeline-parallel layout the ranks of one model
replica score their share together (:mod:`mg.evaluate.model_parallel`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mg.evaluate import distributed
from mg.evaluate.model_parallel import EvalModel
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


def score_sequences(
    model: torch.nn.Module | EvalModel,
    items: Sequence[Scored],
    micro_batch_size: int,
    desc: str = "eval",
) -> list[SequenceScore]:
    """One score per item, in order, on every rank.

    ``model`` is a whole model (data parallel over the world under torchrun) or
    an :class:`EvalModel` in a tensor/pipeline-parallel layout, whose
    data-parallel group splits the items."""
    model = EvalModel.whole(model)
    group = model.layout.dp_group
    # a pipeline's receive buffers have one shape: pad every batch to the longest item
    width = max(len(item.tokens) for item in items) if model.fixed_shape and items else None
    total = len(items)
    items = distributed.shard(items, group)
    batches = [items[i : i + micro_batch_size] for i in range(0, len(items), micro_batch_size)]
    collated = (_collate(batch, width) for batch in progress(batches, len(batches), desc))
    scored = model.run(collated, _scores)
    return distributed.unshard([s for batch in scored for s in batch], total, group)


def _collate(batch: Sequence[Scored], width: int | None) -> dict[str, torch.Tensor]:
    """Right-padded inputs, labels and mask (width: the longest item's, or ``width``)."""
    width = width or max(len(item.tokens) for item in batch)
    tokens = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width - 1, dtype=torch.bool)
    for row, item in enumerate(batch):
        tokens[row, : len(item.tokens)] = torch.as_tensor(item.tokens, dtype=torch.long)
        mask[row, : len(item.mask)] = torch.as_tensor(item.mask, dtype=torch.bool)
    return {
        "tokens": tokens[:, :-1],
        "position_ids": torch.arange(width - 1).expand(len(batch), width - 1),
        "targets": tokens[:, 1:],
        "mask": mask,
    }


def _scores(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> list[SequenceScore]:
    labels, mask = batch["targets"], batch["mask"]
    logits = logits.float()
    losses = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
    losses = losses.view(labels.shape).double() * mask
    correct = (logits.argmax(-1) == labels) | ~mask
    return [
        SequenceScore(
            loss_sum=float(losses[row].sum()),
            num_targets=int(mask[row].sum()),
            all_correct=bool(correct[row].all()),
        )
        for row in range(len(labels))
    ]
