"""Context parallelism: the sequence split over C ranks, attention as a ring.

Layout (Megatron-Core's, load-balanced for causal attention): a sequence of
length S is cut into 2·C equal chunks and cp rank r holds chunks r and
2C−1−r, concatenated, so every rank gets S/C tokens and the same share of the
causal triangle. `shard_sequence` cuts tokens, labels, loss mask and position
ids that way; position ids carry the *global* positions, so RoPE and learned
absolute positions see the right numbers without the model knowing.

Ring attention (`ring_attention`): step i of C, a rank attends its queries to
the keys/values that started on cp rank (r − i) mod C, while it passes the
block on to r + 1 with `batch_isend_irecv`. With the chunk layout above, a
block from an earlier rank (i ≤ r) is wholly visible to both local query
halves but only its first chunk is (the second lies in the future), and a
block from a later rank is wholly visible to the second query half only. So
step 0 is plain causal attention on the local tokens and every later step is
one unmasked half-block product, as in Megatron's `AttnFuncWithCPAndKVP2P`.
Partial results merge exactly through their log-sum-exp (online softmax).
Backward runs the ring again: the key/value block travels together with its
accumulated dK/dV, which arrive back at their owner after the last step.

Products are computed in fp32 whatever the input dtype, so the result equals
full attention up to float rounding (tests: 1e-5 relative in fp32).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from mg.core.models.config import TransformerConfig
from mg.core.models.core_attention import FlashAttention, SDPAttention
from mg.core.models.moe import TopKRouter


class ContextParallelError(ValueError):
    """A model or batch that context parallelism cannot split; the message says why."""


# --- sharding the batch ----------------------------------------------------------------------


def chunk_indices(seq_length: int, cp_rank: int, cp_size: int) -> Tensor:
    """Global sequence positions held by `cp_rank`: chunks r and 2C−1−r of 2C."""
    if seq_length % (2 * cp_size):
        raise ContextParallelError(
            f"sequence length {seq_length} is not divisible by 2 × context-parallel size "
            f"({2 * cp_size}); choose --seq-length as a multiple of {2 * cp_size}"
        )
    chunk = seq_length // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    second_start = (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([first, torch.arange(second_start, second_start + chunk)])


def shard_sequence(tensor: Tensor, cp_rank: int, cp_size: int, seq_dim: int = 1) -> Tensor:
    """This rank's S/C tokens of `tensor` along `seq_dim` (Megatron's load-balanced split)."""
    if cp_size == 1:
        return tensor
    index = chunk_indices(tensor.shape[seq_dim], cp_rank, cp_size).to(tensor.device)
    return tensor.index_select(seq_dim, index)


def shard_batch(batch: dict[str, Tensor], cp_rank: int, cp_size: int) -> dict[str, Tensor]:
    """Split a GPT micro-batch (tokens, labels, loss_mask, position_ids) for context parallelism.

    position_ids are added (0..S−1 per row) when missing, then split too, so the
    model sees global positions. A per-sample `attention_mask` cannot be split
    this way and is refused."""
    if cp_size == 1:
        return batch
    if batch.get("attention_mask") is not None:
        raise ContextParallelError(
            "context parallelism does not support an attention mask in the batch "
            "(--reset-attention-mask); drop that flag or use --context-parallel-size 1"
        )
    tokens = batch["tokens"]
    out = dict(batch)
    if "position_ids" not in out:
        b, s = tokens.shape
        out["position_ids"] = torch.arange(s, device=tokens.device).expand(b, s)
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        if key in out and out[key] is not None:
            out[key] = shard_sequence(out[key], cp_rank, cp_size)
    return out


def unshard_sequence(local: Tensor, group: dist.ProcessGroup, seq_dim: int = 1) -> Tensor:
    """Inverse of `shard_sequence`: all-gather the shards and put tokens back in order."""
    cp_size = dist.get_world_size(group)
    parts = [torch.empty_like(local) for _ in range(cp_size)]
    dist.all_gather(parts, local.contiguous(), group=group)
    seq_length = local.shape[seq_dim] * cp_size
    order = torch.cat([chunk_indices(seq_length, r, cp_size) for r in range(cp_size)])
    gathered = torch.cat(parts, dim=seq_dim)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(seq_length)
    return gathered.index_select(seq_dim, inverse.to(local.device))


# --- one block of attention with its log-sum-exp ---------------------------------------------


def _expand_groups(kv: Tensor, num_heads: int) -> Tensor:
    """[b, groups, s, d] → [b, heads, s, d]; query head h reads group h // (heads/groups)."""
    rep = num_heads // kv.shape[1]
    return kv if rep == 1 else kv.repeat_interleave(rep, dim=1)


def _reduce_groups(grad: Tensor, num_groups: int) -> Tensor:
    """Gradient of `_expand_groups`: sum the query heads that shared a key/value head."""
    b, h, s, d = grad.shape
    return grad if h == num_groups else grad.view(b, num_groups, h // num_groups, s, d).sum(2)


def _block_forward(
    q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool
) -> tuple[Tensor, Tensor]:
    """softmax(q kᵀ·scale) v and its log-sum-exp, fp32, heads layout [b, h, s, d]."""
    scores = torch.matmul(q, _expand_groups(k, q.shape[1]).transpose(-1, -2)) * scale
    if causal:
        sq, sk = scores.shape[-2:]
        allowed = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), _expand_groups(v, q.shape[1]))
    return out, lse


def _merge(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
    """Online-softmax merge of a block result into the running (out, lse), in place."""
    new_lse = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new_lse).unsqueeze(-1)).add_(
        block_out * torch.exp(block_lse - new_lse).unsqueeze(-1)
    )
    lse.copy_(new_lse)


def _block_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    grad_out: Tensor,
    lse: Tensor,
    scale: float,
    causal: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of one block given the *final* out and log-sum-exp (flash-attention style)."""
    heads, groups = q.shape[1], k.shape[1]
    k_full, v_full = _expand_groups(k, heads), _expand_groups(v, heads)
    scores = torch.matmul(q, k_full.transpose(-1, -2)) * scale
    probs = torch.exp(scores - lse.unsqueeze(-1))
    if causal:
        sq, sk = scores.shape[-2:]
        allowed = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril()
        probs = probs.masked_fill(~allowed, 0.0)
    grad_v = torch.matmul(probs.transpose(-1, -2), grad_out)
    grad_probs = torch.matmul(grad_out, v_full.transpose(-1, -2))
    delta = (grad_out * out).sum(-1, keepdim=True)
    grad_scores = probs * (grad_probs - delta) * scale
    grad_q = torch.matmul(grad_scores, k_full)
    grad_k = torch.matmul(grad_scores.transpose(-1, -2), q)
    return grad_q, _reduce_groups(grad_k, groups), _reduce_groups(grad_v, groups)


# --- the ring --------------------------------------------------------------------------------


class _Ring:
    """Pass tensors to cp rank r+1 and receive from r−1 (batch_isend_irecv, gloo and NCCL)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start(self, send: Tensor) -> tuple[Tensor, list]:
        recv = torch.empty_like(send)
        ops = [
            dist.P2POp(dist.isend, send, self.next, self.group),
            dist.P2POp(dist.irecv, recv, self.prev, self.group),
        ]
        return recv, dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(requests: list) -> None:
        for request in requests:
            request.wait()


def _source(cp_rank: int, step: int, cp_size: int) -> int:
    return (cp_rank - step) % cp_size


class _RingAttention(torch.autograd.Function):
    """Causal load-balanced ring attention on [b, heads|groups, s_local, d] fp32 tensors."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, scale: float, group) -> Tensor:
        ring = _Ring(group)
        half = q.shape[2] // 2
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=q.dtype, device=q.device)
        kv = torch.stack([k, v])
        for step in range(ring.size):
            if step + 1 < ring.size:
                next_kv, requests = ring.start(kv)
            if step == 0:
                # local chunks r and 2C−1−r: causal within the concatenation is exact, since
                # every position of the first chunk precedes every position of the second
                block_out, block_lse = _block_forward(q, kv[0], kv[1], scale, causal=True)
                _merge(out, lse, block_out, block_lse)
            elif _source(ring.rank, step, ring.size) < ring.rank:
                block_out, block_lse = _block_forward(
                    q, kv[0, :, :, :half], kv[1, :, :, :half], scale, causal=False
                )
                _merge(out, lse, block_out, block_lse)
            else:
                block_out, block_lse = _block_forward(q[:, :, half:], kv[0], kv[1], scale, False)
                _merge(out[:, :, half:], lse[:, :, half:], block_out, block_lse)
            if step + 1 < ring.size:
                ring.wait(requests)
                kv = next_kv
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.group = scale, group
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        scale, ring = ctx.scale, _Ring(ctx.group)
        half = q.shape[2] // 2
        grad_out = grad_out.contiguous()
        grad_q = torch.zeros_like(q)
        # kv block and its dk/dv accumulator travel together: [k, v, dk, dv]
        travelling = torch.stack([k, v, torch.zeros_like(k), torch.zeros_like(v)])
        for step in range(ring.size):
            kb, vb = travelling[0], travelling[1]
            if step == 0:
                dq, dk, dv = _block_backward(q, kb, vb, out, grad_out, lse, scale, causal=True)
                grad_q += dq
                travelling[2] += dk
                travelling[3] += dv
            elif _source(ring.rank, step, ring.size) < ring.rank:
                dq, dk, dv = _block_backward(
                    q, kb[:, :, :half], vb[:, :, :half], out, grad_out, lse, scale, False
                )
                grad_q += dq
                travelling[2, :, :, :half] += dk
                travelling[3, :, :, :half] += dv
            else:
                dq, dk, dv = _block_backward(
                    q[:, :, half:],
                    kb,
                    vb,
                    out[:, :, half:],
                    grad_out[:, :, half:],
                    lse[:, :, half:],
                    scale,
                    False,
                )
                grad_q[:, :, half:] += dq
                travelling[2] += dk
                travelling[3] += dv
            if ring.size > 1:
                # after the last step only dk/dv travel, one hop home to their owner
                payload = travelling if step + 1 < ring.size else travelling[2:].contiguous()
                received, requests = ring.start(payload)
                ring.wait(requests)
                if step + 1 < ring.size:
                    travelling = received
                else:
                    travelling = torch.cat([travelling[:2], received])
        return grad_q, travelling[2], travelling[3], None, None


def ring_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    group: dist.ProcessGroup,
    softmax_scale: float | None = None,
) -> Tensor:
    """Causal attention over a sequence sharded with `shard_sequence` across `group`.

    query [b, s_local, heads, d], key/value [b, s_local, groups, d] (GQA: heads a
    multiple of groups) → [b, s_local, heads·d], in the input dtype. Equals the
    local rows of full causal attention on the unsharded sequence."""
    b, s, heads, d = query.shape
    if s % 2:
        raise ContextParallelError(f"local sequence length {s} must be even (two chunks)")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    dv = value.shape[-1]
    if dv != d:  # MLA's narrower values: zero-padded to travel stacked with the keys
        value = F.pad(value, (0, d - dv))
    q, k, v = (t.transpose(1, 2).float() for t in (query, key, value))
    out = _RingAttention.apply(q, k, v, scale, group)[..., :dv]
    return out.to(query.dtype).transpose(1, 2).reshape(b, s, heads * dv)


# --- applying it to a model ------------------------------------------------------------------


class RingAttention(nn.Module):
    """Core-attention backend (mg.core.models.core_attention contract) for a cp group."""

    def __init__(self, config: TransformerConfig, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.group = group
        self.softmax_scale = config.attention_softmax_scale  # MLA's with YaRN's mscale
        self.dropout = config.attention_dropout

    def forward(
        self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None = None
    ) -> Tensor:
        if attention_mask is not None:
            raise ContextParallelError(
                "context parallelism does not support an attention mask "
                "(--reset-attention-mask); use --context-parallel-size 1 for that data"
            )
        if self.training and self.dropout > 0:
            raise ContextParallelError(
                "context parallelism does not support attention dropout; set --attention-dropout 0"
            )
        return ring_attention(query, key, value, self.group, self.softmax_scale)


def apply_context_parallel(
    model: nn.Module, group: dist.ProcessGroup, tp_cp_group: dist.ProcessGroup | None = None
) -> nn.Module:
    """Swap every causal SDPA core-attention module of `model` for `RingAttention` in place.

    The model must then be fed `shard_batch`'d micro-batches (global position
    ids included). Sliding-window attention and non-SDPA backends are refused:
    their ring variants do not exist here. `tp_cp_group`: the tensor × context
    ranks of a sequence, for MoE layers whose tensor-parallel ranks route their own
    tokens (an expert tensor-parallel size below tp): their routers count the
    sequence's tokens over it."""
    if dist.get_world_size(group) == 1:
        return model
    config = getattr(model, "config", None)
    if config is None:
        raise ContextParallelError("apply_context_parallel needs a model with a .config")
    if config.window_size is not None:
        raise ContextParallelError(
            "context parallelism does not support sliding-window attention (--window-size)"
        )
    if getattr(config, "softmax_type", "vanilla") != "vanilla":
        raise ContextParallelError(
            f"context parallelism does not support attention sinks (--softmax-type "
            f"{config.softmax_type}): the ring attention has no sink logit"
        )
    # the TE spec's attention becomes TE's DotProductAttention, told the cp group
    # (mg.core.models.te_parallel), whatever kernel the plain model picked
    ringable = (
        (SDPAttention, FlashAttention)
        if config.transformer_impl == "transformer_engine"
        else SDPAttention
    )
    swapped = 0
    for module in list(model.modules()):
        attention = getattr(module, "core_attention", None)
        if attention is None:
            continue
        if not isinstance(attention, ringable) or not attention.causal:
            raise ContextParallelError(
                f"context parallelism needs causal attention with the sdpa backend; "
                f"{type(attention).__name__} (attention_backend={config.attention_backend!r}) "
                "has no ring variant here"
            )
        module.core_attention = RingAttention(config, group)
        swapped += 1
    if swapped == 0:
        raise ContextParallelError("apply_context_parallel found no core_attention modules")
    for router in (m for m in model.modules() if isinstance(m, TopKRouter)):
        # MoE layers are token-wise; the balancing losses count the whole sequence's tokens
        before = router.tp_cp_group
        if before is not None and tp_cp_group is None:  # TP ranks route their own tokens
            raise ContextParallelError(
                "context parallelism with MoE layers whose tensor-parallel ranks route their "
                "own tokens (--expert-tensor-parallel-size below --tensor-model-parallel-size) "
                "needs their tensor x context group (tp_cp_group)"
            )
        router.tp_cp_group = group if before is None else tp_cp_group
        if router.tp_dp_cp_group is None or router.tp_dp_cp_group is before:
            router.tp_dp_cp_group = router.tp_cp_group
    return model
