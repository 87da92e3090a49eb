"""The tied embedding's weight gradient summed in one tensor (fully sharded training).

A weight that the lookup and the output head share gets its gradient from
autograd only once both backwards have run: the head's part (gᵀx), the lookup's
part (its rows scattered into a dense zero tensor) and their sum, three
vocab × hidden tensors alive at once at the embedding's backward. Under ZeRO-3
that moment is a small model's peak (`bench/results/fsdp-cpu-275m.md`).

Here the head's backward leaves its part in a `TiedGradient` and returns no
gradient for the weight; the lookup's backward scatters its rows into that one
tensor and hands it to autograd as the weight's whole gradient. Where the head saw
fewer tokens than the hidden size, it leaves (g, x) instead, smaller than gᵀx,
and the product is formed at the lookup's backward, when FSDP no longer holds
the gathered weight (the head's backward freed it). Megatron's gradient
accumulation fusion does the same kind of thing: a backward writes its weight
gradient into the one buffer kept for it.

The numbers are the plain head's and lookup's but for the order of the sum (the
lookup's rows are added one by one onto the head's part).

Only where one head call and one lookup share the weight per forward (no MTP,
whose depths call both several times): `fully_sharded.py` sets it up.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


class TiedGradient:
    """The head's parts of the tied weight's gradient, waiting for the lookup's backward:
    summed products (vocab × hidden) or, where smaller, the factors (g, x)."""

    def __init__(self) -> None:
        self.summed: Tensor | None = None
        self.factors: list[tuple[Tensor, Tensor]] = []

    def add_head(self, grad_logits: Tensor, hidden: Tensor) -> None:
        """One head backward's part: `grad_logits` (tokens × vocab), `hidden` (tokens ×
        hidden)."""
        if grad_logits.shape[0] < hidden.shape[1]:
            self.factors.append((grad_logits, hidden))
        else:
            self.summed = _plus_product(self.summed, grad_logits, hidden)

    def take(self) -> Tensor | None:
        """The heads' parts summed into one tensor (None if there were none), which the
        caller now owns; nothing is left pending."""
        total, self.summed = self.summed, None
        for grad_logits, hidden in self.factors:
            total = _plus_product(total, grad_logits, hidden)
        self.factors.clear()
        return total

    def clear(self) -> None:
        """Drop what an unfinished backward left."""
        self.summed = None
        self.factors.clear()


def _plus_product(total: Tensor | None, grad_logits: Tensor, hidden: Tensor) -> Tensor:
    """total + grad_logitsᵀ hidden, added in place where `total` exists."""
    if total is None:
        return grad_logits.t().mm(hidden)
    return total.addmm_(grad_logits.t(), hidden)


class _TiedLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, tied: TiedGradient) -> Tensor:
        ctx.save_for_backward(hidden, weight)
        ctx.tied = tied
        return F.linear(hidden, weight)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, None, None]:
        hidden, weight = ctx.saved_tensors
        grad_hidden = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        ctx.tied.add_head(grad.reshape(-1, grad.shape[-1]), hidden.reshape(-1, hidden.shape[-1]))
        return grad_hidden, None, None


class _TiedLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: Tensor, weight: Tensor, tied: TiedGradient) -> Tensor:
        ctx.save_for_backward(ids)
        ctx.tied = tied
        ctx.weight_shape, ctx.weight_dtype = weight.shape, weight.dtype
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[None, Tensor, None]:
        (ids,) = ctx.saved_tensors
        total = ctx.tied.take()
        if total is None:
            total = grad.new_zeros(ctx.weight_shape, dtype=ctx.weight_dtype)
        rows = grad.reshape(-1, grad.shape[-1]).to(total.dtype)
        total.index_add_(0, ids.reshape(-1), rows)
        return None, total, None


def tied_logits(hidden: Tensor, weight: Tensor, tied: TiedGradient | None) -> Tensor:
    """hidden @ weightᵀ; with `tied` (and a gradient to make) the weight's part of the
    gradient is left there for `tied_lookup`'s backward."""
    if tied is None or not (torch.is_grad_enabled() and weight.requires_grad):
        return F.linear(hidden, weight)
    return _TiedLogits.apply(hidden, weight, tied)


def tied_lookup(ids: Tensor, weight: Tensor, tied: TiedGradient | None) -> Tensor:
    """weight[ids]; with `tied` its backward returns the weight's whole gradient: the
    heads' parts left in `tied` plus its own rows."""
    if tied is None or not (torch.is_grad_enabled() and weight.requires_grad):
        return F.embedding(ids, weight)
    tied.clear()
    return _TiedLookup.apply(ids, weight, tied)
