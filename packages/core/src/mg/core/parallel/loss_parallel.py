"""Vocab-parallel output layer and cross-entropy: full logits are never gathered.

Each tensor-parallel rank holds rows [start, end) of the [vocab, hidden]
output matrix (the vocab-parallel embedding when the weights are tied), so it
computes logits for its slice of the vocabulary only. The cross-entropy is
Megatron's `_VocabParallelCrossEntropy` (megatron/core/tensor_parallel/
cross_entropy.py): three all-reduces of [tokens]-sized tensors (max logit, the
target's logit, the sum of exps) instead of an all-gather of [tokens, vocab].
`VocabParallelOutputHead` is the model's output head that computes it
(mg.core.models.output_head), chosen by `apply_tensor_parallel`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from mg.core.models.output_head import HasOutputWeight, OutputHead, real_vocab_size
from mg.core.models.vocab_mask import mask_padded_vocab


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy from vocab-sharded logits [tokens, vocab/tp] (fp32)."""

    @staticmethod
    def forward(
        ctx: Any, logits: Tensor, target: Tensor, vocab_start: int, group: dist.ProcessGroup
    ) -> Tensor:
        logits_max = logits.max(dim=-1).values
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)

        vocab_end = vocab_start + logits.shape[-1]
        outside = (target < vocab_start) | (target >= vocab_end)
        local_target = (target - vocab_start).masked_fill(outside, 0)
        rows = torch.arange(logits.shape[0], device=logits.device)
        predicted = shifted[rows, local_target].masked_fill(outside, 0.0)
        dist.all_reduce(predicted, group=group)

        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        loss = sum_exp.log() - predicted

        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), outside, local_target)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor) -> tuple[Tensor | None, ...]:
        softmax, outside, local_target = ctx.saved_tensors
        grad = softmax
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_target] -= (~outside).to(grad.dtype)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None, None


def vocab_parallel_cross_entropy(
    logits: Tensor, target: Tensor, vocab_start: int, group: dist.ProcessGroup
) -> Tensor:
    """Unreduced cross-entropy [tokens] of vocab-sharded fp32 logits [tokens, vocab/tp]."""
    return _VocabParallelCrossEntropy.apply(logits, target, vocab_start, group)


def replicate_for_tensor_parallel(hidden: Tensor, tp_mesh: DeviceMesh) -> Tensor:
    """The full [b, s, h] activations as a local tensor, whatever their TP layout.

    A plain tensor is taken as replicated (no sequence parallelism); a
    sequence-sharded DTensor is all-gathered. Either way the gradient coming
    back is a partial sum per rank (each rank saw only its vocab slice), so it
    is marked Partial: all-reduced (or reduce-scattered to the sequence
    shards) in backward — Megatron's copy/gather-to-tensor-parallel regions.
    """
    if not isinstance(hidden, DTensor):
        hidden = DTensor.from_local(hidden, tp_mesh, [Replicate()], run_check=False)
    return hidden.redistribute(tp_mesh, [Replicate()]).to_local(grad_placements=[Partial()])


def vocab_parallel_output(
    hidden: Tensor,
    weight: DTensor,
    labels: Tensor | None,
    tp_mesh: DeviceMesh,
    real_vocab_size: int | None = None,
    bias: DTensor | None = None,
) -> Tensor:
    """logits [b, s, vocab] (gathered only when no labels are given) or the
    per-token fp32 cross-entropy [b, s], from a vocab-sharded output weight
    (and bias: BERT's and T5's output layers have one); rows >= real_vocab_size
    (the padding) at -inf when it is given."""
    if weight.placements != (Shard(0),):
        raise ValueError(f"output weight must be vocab-sharded (Shard(0)), got {weight.placements}")
    full_hidden = replicate_for_tensor_parallel(hidden, tp_mesh)
    local_weight = weight.to_local()
    local_bias = None if bias is None else bias.to_local()
    vocab_start = tp_mesh.get_local_rank() * local_weight.shape[0]
    logits = F.linear(full_hidden, local_weight, local_bias)
    logits = mask_padded_vocab(logits, real_vocab_size, vocab_start)
    if labels is None:
        return DTensor.from_local(logits, tp_mesh, [Shard(-1)], run_check=False).full_tensor()
    b, s = labels.shape
    loss = vocab_parallel_cross_entropy(
        logits.float().flatten(0, 1), labels.flatten(), vocab_start, tp_mesh.get_group()
    )
    return loss.view(b, s)


class VocabParallelOutputHead(OutputHead):
    """A model's output under tensor parallelism: `vocab_parallel_output` on its vocab-
    sharded output weight (and bias), over `tp_mesh`."""

    def __init__(self, tp_mesh: DeviceMesh) -> None:
        self.tp_mesh = tp_mesh

    def __call__(self, model: HasOutputWeight, hidden: Tensor, labels: Tensor | None) -> Tensor:
        return vocab_parallel_output(
            hidden,
            model.output_weight(),
            labels,
            self.tp_mesh,
            real_vocab_size(model),
            bias=model.output_bias(),
        )

    def __repr__(self) -> str:
        return f"VocabParallelOutputHead(tp={self.tp_mesh.size()})"
