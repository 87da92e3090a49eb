"""The tied embedding over the data-parallel ranks' shards of its vocabulary (FSDP).

Under ZeRO-3 each rank holds 1/DP of the tied vocab × hidden weight's rows anyway.
Gathering it whole for the lookup and again for the output head, and reduce-scattering
its whole gradient, is at a small model's scale the largest transient of a step
(`bench/results/fsdp-cpu-275m.md`) and its largest collective. Here the weight stays
sharded and the ranks exchange their tokens instead, which are small beside it
(T × hidden and T × vocab against vocab × hidden; 0.8 MB and 26 MB against 309 MB at
the 275M benchmark's 128 tokens a rank):

- lookup: the token ids are all-gathered; each rank looks up the tokens whose rows it
  holds (zeros for the others), and a reduce-scatter sums each rank's own tokens'
  rows. Backward: the rows' gradients are all-gathered and each rank adds those of
  its own rows into its shard's gradient.
- logits: the hidden states are all-gathered; each rank multiplies every token by its
  rows, and an all-to-all hands each rank its own tokens' logits over the whole
  vocabulary, as the plain head's. Backward: the logits' gradient goes back through
  the all-to-all; each rank forms its rows' gradient and its part of every token's
  hidden gradient, which a reduce-scatter sums. Where a rank has more tokens than the
  hidden size, its logits are larger than the weight: the rows are all-gathered
  instead (again in the backward, not kept) and the weight's gradient reduce-scattered,
  as FSDP would, without FSDP's copies of them.

This is Megatron's vocab-parallel embedding and output layer over the data-parallel
group instead of the tensor-parallel one, with whole logits at the end so that the
loss is untouched. The weight's gradient comes out reduced over the group: divided by
its size, as FSDP2 averages the gradients it reduces.

Collectives only (all-gather, reduce-scatter, all-to-all of equal splits), each rank
calling them in the same order: NCCL's contract, and gloo's. On gloo the all-gathers
and reduce-scatters run in place, as FSDP's units' do there (`fully_sharded_gloo`).
Every rank's micro-batch has the same shape, as in training: checked, since a mismatch
would hang a collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor

from mg.core.parallel.fully_sharded_gloo import (
    all_reduce_scatter,
    broadcast_all_gather,
    uses_gloo,
)


class VocabShards:
    """A data-parallel group's rows of the tied weight: where this rank's start, and the
    collectives over the group. `dtype`: the compute dtype (FSDP's param_dtype)."""

    def __init__(self, group: dist.ProcessGroup, vocab: int, dtype: torch.dtype | None) -> None:
        self.group = group
        self.size = group.size()
        self.rank = group.rank()
        rows = -(-vocab // self.size)  # torch.chunk's (DTensor Shard(0)'s) split
        self.widths = [max(0, min(rows, vocab - rows * r)) for r in range(self.size)]
        self.start = min(rows * self.rank, vocab)
        self.vocab = vocab
        self.dtype = dtype
        self.in_place = uses_gloo(group)
        """gloo: all-gathers as broadcasts, reduce-scatters as an all-reduce in place
        (`fully_sharded_gloo`: gloo's own copy the whole tensor and are slower)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(ranks={self.size}, vocab={self.vocab})"

    def lookup(self, ids: Tensor, weight: Tensor) -> Tensor:
        """weight[ids] for this rank's `ids`, `weight` its DTensor (Shard(0) over the group)."""
        return _Lookup.apply(ids, self._local(weight), self)

    def logits(self, hidden: Tensor, weight: Tensor) -> Tensor:
        """hidden @ weightᵀ for this rank's `hidden`: its tokens' logits, the whole vocab."""
        return _Logits.apply(hidden, self._local(weight), self)

    def _local(self, weight: Tensor) -> Tensor:
        local = weight.to_local() if isinstance(weight, DTensor) else weight
        return local if self.dtype is None else local.to(self.dtype)

    def gather(self, tensor: Tensor) -> Tensor:
        """Every rank's `tensor` (same shape), stacked on a new first dim."""
        out = tensor.new_empty(self.size * tensor.numel())
        if self.in_place:
            out.view(self.size, -1)[self.rank].copy_(tensor.reshape(-1))
            broadcast_all_gather(out, self.group)
        else:
            dist.all_gather_into_tensor(out, tensor.reshape(-1).contiguous(), group=self.group)
        return out.view(self.size, *tensor.shape)

    def scatter_sum(self, stacked: Tensor) -> Tensor:
        """The sum over ranks of `stacked` (one slice per rank), this rank's slice; on gloo
        `stacked` (a temporary at every call) is summed in place."""
        out = stacked.new_empty(stacked[0].numel())
        if self.in_place:
            all_reduce_scatter(out, stacked.contiguous(), self.group)
        else:
            dist.reduce_scatter_tensor(out, stacked.reshape(-1).contiguous(), group=self.group)
        return out.view(stacked.shape[1:])

    def exchange(self, parts: Tensor) -> Tensor:
        """All-to-all of `parts` [ranks, ...]: slice r goes to rank r; returns what each rank
        sent here, stacked [ranks, ...]."""
        out = torch.empty_like(parts)
        dist.all_to_all_single(out, parts.contiguous(), group=self.group)
        return out

    def check_shape(self, tensor: Tensor) -> None:
        """Every rank's micro-batch must have this shape (the collectives' splits)."""
        shape = torch.tensor(list(tensor.shape), dtype=torch.int64, device=tensor.device)
        shapes = self.gather(shape)
        if not bool((shapes == shape).all()):
            raise ValueError(
                f"the data-parallel ranks' micro-batches differ in shape ({shapes.tolist()}); "
                "the vocabulary-sharded embedding needs them equal"
            )


class _Lookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: Tensor, local: Tensor, shards: VocabShards) -> Tensor:
        shards.check_shape(ids)
        every = shards.gather(ids)  # [ranks, *ids.shape]
        rows = every - shards.start
        mine = (rows >= 0) & (rows < local.shape[0])
        rows = torch.where(mine, rows, torch.zeros_like(rows))
        found = F.embedding(rows, local) * mine.unsqueeze(-1).to(local.dtype)
        ctx.save_for_backward(rows, mine)
        ctx.shards, ctx.local_shape = shards, local.shape
        return shards.scatter_sum(found)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[None, Tensor, None]:
        rows, mine = ctx.saved_tensors
        shards = ctx.shards
        every = shards.gather(grad)  # [ranks, *grad.shape]
        hidden = every.shape[-1]
        grad_local = grad.new_zeros(ctx.local_shape)
        picked = mine.reshape(-1)
        grad_local.index_add_(0, rows.reshape(-1)[picked], every.reshape(-1, hidden)[picked])
        return None, grad_local.div_(shards.size), None


class _Logits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, local: Tensor, shards: VocabShards) -> Tensor:
        shards.check_shape(hidden)
        widths = shards.widths
        ctx.shards, ctx.widths = shards, widths
        ctx.exchanged = hidden.numel() // hidden.shape[-1] <= hidden.shape[-1]
        ctx.save_for_backward(hidden, local)
        if not ctx.exchanged:  # more tokens than the hidden size: the rows are smaller
            return F.linear(hidden, _gather_rows(shards, local, widths))
        every = shards.gather(hidden)  # [ranks, ..., hidden]
        part = F.linear(every, local)  # every token, this rank's rows (padded: equal splits)
        part = F.pad(part, (0, max(widths) - local.shape[0]))
        parts = shards.exchange(part)  # [ranks, ..., rows of rank r] for this rank's tokens
        return _join(parts, widths)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        hidden, local = ctx.saved_tensors
        shards, widths, size = ctx.shards, ctx.widths, hidden.shape[-1]
        if not ctx.exchanged:
            grad_hidden = grad.matmul(_gather_rows(shards, local, widths))
            grad_rows = grad.reshape(-1, grad.shape[-1]).t().mm(hidden.reshape(-1, size))
            grad_local = shards.scatter_sum(_split(grad_rows.t(), widths).transpose(1, 2))
            return grad_hidden, grad_local[: local.shape[0]].div_(shards.size), None
        every = shards.gather(hidden)
        part = shards.exchange(_split(grad, widths))[..., : local.shape[0]]  # every token
        grad_hidden = shards.scatter_sum(part.matmul(local))
        grad_local = part.reshape(-1, local.shape[0]).t().mm(every.reshape(-1, size))
        return grad_hidden, grad_local.div_(shards.size), None


def _gather_rows(shards: VocabShards, local: Tensor, widths: list[int]) -> Tensor:
    """The whole vocab × hidden weight from every rank's rows."""
    padded = F.pad(local, (0, 0, 0, max(widths) - local.shape[0]))
    return torch.cat([rows[:w] for rows, w in zip(shards.gather(padded), widths, strict=True)])


def _join(parts: Tensor, widths: list[int]) -> Tensor:
    """[ranks, ..., padded rows] → [..., vocab]: each rank's rows, in order."""
    return torch.cat([parts[r, ..., :w] for r, w in enumerate(widths)], dim=-1)


def _split(grad: Tensor, widths: list[int]) -> Tensor:
    """[..., vocab] → [ranks, ..., padded rows]: each rank's columns, zero-padded."""
    out = grad.new_zeros((len(widths), *grad.shape[:-1], max(widths)))
    start = 0
    for r, w in enumerate(widths):
        out[r, ..., :w] = grad[..., start : start + w]
        start += w
    return out
