"""Token dispatch: bring each token to the experts it was routed to, and the results back.

    dispatch(tokens [T, h], probs [T, E], routing_map [T, E])
        → rows grouped by local expert, tokens_per_expert (list), their probabilities, a handle
    combine(expert_output, handle) → [T, h]: each token's expert outputs summed

A token routed to k experts appears k times between the two ("permute" /
"unpermute" in Megatron's terms: rows sorted expert by expert, each expert's
rows in token order). The dispatchers are plain objects holding the expert-
parallel process group they are handed (None: this process has every expert
and nothing is communicated, the model's default).

- `AllGatherDispatcher` (Megatron's "allgather"): every EP rank gathers all
  ranks' tokens, runs its own experts on the ones routed to them, and the
  partial outputs are reduce-scattered back.
- `AllToAllDispatcher` (Megatron's "alltoall"): each rank sends every expert
  only its tokens, in one all-to-all each way (uneven splits; gloo and NCCL).

Collectives are autograd functions, so gradients take the mirror path
(all-gather ↔ reduce-scatter, all-to-all ↔ all-to-all with the splits swapped).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor


def permute(tokens: Tensor, routing_map: Tensor, probs: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Rows of `tokens` expert by expert (token order within an expert), their probs,
    and the token index of each row."""
    num_tokens, num_experts = routing_map.shape
    mask = routing_map.T.contiguous()  # [E, T]
    token_index = torch.arange(num_tokens, device=tokens.device).expand(num_experts, -1)
    sorted_indices = token_index.masked_select(mask)
    permuted_probs = probs.T.contiguous().masked_select(mask)
    return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices


def unpermute(rows: Tensor, sorted_indices: Tensor, num_tokens: int) -> Tensor:
    """Sum each token's rows back into place: [rows, h] → [num_tokens, h]."""
    out = torch.zeros(num_tokens, rows.shape[-1], dtype=rows.dtype, device=rows.device)
    return out.index_add(0, sorted_indices, rows)


class _GatherRows(torch.autograd.Function):
    """All-gather along dim 0 (equal row counts); backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:  # type: ignore[override]
        ctx.group = group
        return _all_gather(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return _reduce_scatter(grad, ctx.group), None


class _ReduceScatterRows(torch.autograd.Function):
    """Sum over the group and keep this rank's block of rows; backward all-gathers."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:  # type: ignore[override]
        ctx.group = group
        return _reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return _all_gather(grad, ctx.group), None


def _reduce_scatter(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    size = dist.get_world_size(group)
    out = x.new_empty(x.shape[0] // size, *x.shape[1:])
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


def _all_gather(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    size = dist.get_world_size(group)
    out = x.new_empty(x.shape[0] * size, *x.shape[1:])
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def gather_rows(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """All-gather along dim 0 over `group`; the gradient is reduce-scattered back."""
    return _GatherRows.apply(x, group)


def reduce_scatter_rows(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Sum over `group`, keep this rank's block of rows; the gradient is all-gathered."""
    return _ReduceScatterRows.apply(x, group)


class _AllToAll(torch.autograd.Function):
    """Uneven all-to-all of rows; backward sends the gradients back the same way."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, x: Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup
    ) -> Tensor:
        ctx.splits, ctx.group = (input_splits, output_splits), group
        out = x.new_empty(sum(output_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:  # type: ignore[override]
        back_out, back_in = ctx.splits
        out = grad.new_empty(sum(back_out), *grad.shape[1:])
        dist.all_to_all_single(out, grad.contiguous(), back_out, back_in, group=ctx.group)
        return out, None, None, None


@dataclass
class DispatchHandle:
    """What combine needs to undo a dispatch."""

    sorted_indices: Tensor
    num_tokens: int
    send_splits: list[int] | None = None
    recv_splits: list[int] | None = None
    chunk_sizes: list[int] | None = None
    """All-to-all: received row counts per (source rank, local expert), source-major."""


def _rank_group_info(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


class AllGatherDispatcher:
    """Gather all EP ranks' tokens; run the local experts; reduce-scatter the outputs.

    With `group=None` (one process holds every expert) nothing is communicated."""

    def __init__(self, num_experts: int, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.num_experts = num_experts
        size, rank = _rank_group_info(group)
        self.num_local_experts = num_experts // size
        self.local_experts = slice(
            rank * self.num_local_experts, (rank + 1) * self.num_local_experts
        )

    def dispatch(
        self, tokens: Tensor, probs: Tensor, routing_map: Tensor
    ) -> tuple[Tensor, list[int], Tensor, DispatchHandle]:
        if self.group is not None and dist.get_world_size(self.group) > 1:
            tokens = _GatherRows.apply(tokens, self.group)
            probs = _GatherRows.apply(probs, self.group)
            gathered = torch.empty(
                tokens.shape[0], routing_map.shape[1], dtype=torch.uint8, device=tokens.device
            )  # as bytes: gloo gathers no bool tensors
            dist.all_gather_into_tensor(gathered, routing_map.to(torch.uint8), group=self.group)
            routing_map = gathered.bool()
        local_map = routing_map[:, self.local_experts]
        rows, row_probs, sorted_indices = permute(tokens, local_map, probs[:, self.local_experts])
        tokens_per_expert = local_map.sum(dim=0).tolist()
        return rows, tokens_per_expert, row_probs, DispatchHandle(sorted_indices, tokens.shape[0])

    def combine(self, rows: Tensor, handle: DispatchHandle) -> Tensor:
        out = unpermute(rows, handle.sorted_indices, handle.num_tokens)
        if self.group is not None and dist.get_world_size(self.group) > 1:
            out = _ReduceScatterRows.apply(out, self.group)
        return out


class AllToAllDispatcher:
    """Send each token to the EP rank of each of its experts, in one all-to-all each way.

    Experts are split over the group in order: rank r holds experts
    r·E/ep … (r+1)·E/ep − 1 (Megatron's `local_expert_indices`)."""

    def __init__(self, num_experts: int, group: dist.ProcessGroup) -> None:
        self.group = group
        self.num_experts = num_experts
        self.size, self.rank = _rank_group_info(group)
        self.num_local_experts = num_experts // self.size

    def dispatch(
        self, tokens: Tensor, probs: Tensor, routing_map: Tensor
    ) -> tuple[Tensor, list[int], Tensor, DispatchHandle]:
        ep, local = self.size, self.num_local_experts
        counts = routing_map.sum(dim=0)  # [E] rows this rank sends to each expert
        all_counts = counts.new_empty(ep * self.num_experts)
        dist.all_gather_into_tensor(all_counts, counts, group=self.group)
        all_counts = all_counts.view(ep, self.num_experts)
        # received[src, e]: rows rank src sends to our local expert e
        received = all_counts[:, self.rank * local : (self.rank + 1) * local]
        send_splits = counts.view(ep, local).sum(dim=1).tolist()
        recv_splits = received.sum(dim=1).tolist()
        rows, row_probs, sorted_indices = permute(tokens, routing_map, probs)
        rows = _AllToAll.apply(rows, recv_splits, send_splits, self.group)
        row_probs = _AllToAll.apply(row_probs, recv_splits, send_splits, self.group)
        chunk_sizes = received.flatten().tolist()
        expert_major = [s * local + e for e in range(local) for s in range(ep)]
        rows = _reorder_chunks(rows, chunk_sizes, expert_major)
        row_probs = _reorder_chunks(row_probs, chunk_sizes, expert_major)
        handle = DispatchHandle(
            sorted_indices, tokens.shape[0], send_splits, recv_splits, chunk_sizes
        )
        return rows, received.sum(dim=0).tolist(), row_probs, handle

    def combine(self, rows: Tensor, handle: DispatchHandle) -> Tensor:
        ep, local = self.size, self.num_local_experts
        sizes = handle.chunk_sizes
        expert_major_sizes = [sizes[s * local + e] for e in range(local) for s in range(ep)]
        source_major = [e * ep + s for s in range(ep) for e in range(local)]
        rows = _reorder_chunks(rows, expert_major_sizes, source_major)
        rows = _AllToAll.apply(rows, handle.send_splits, handle.recv_splits, self.group)
        return unpermute(rows, handle.sorted_indices, handle.num_tokens)


def _reorder_chunks(x: Tensor, sizes: list[int], order: list[int]) -> Tensor:
    """Split `x` into chunks of `sizes` and concatenate them in `order`."""
    chunks = x.split(sizes)
    return torch.cat([chunks[i] for i in order], dim=0)
