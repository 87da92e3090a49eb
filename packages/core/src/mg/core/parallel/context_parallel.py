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
A sliding window masks every block by the global positions of its queries and
keys (a block it hides wholly is skipped); attention sinks (gpt-oss) start each
row's running log-sum-exp at the head's sink logit, so the sink is in the
denominator once, however many blocks merge.
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
from mg.core.models.core_attention import FlashAttention, SDPAttention, sink_logits
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


def block_mask(q_pos: Tensor, k_pos: Tensor, window: tuple[int, int] | None) -> Tensor:
    """Bool [sq, sk], True where a query at global position q_pos[i] may attend the key at
    k_pos[j]: causal (k ≤ q), and within a sliding window (q − left ≤ k) when given. Built
    from global positions, so a window crosses chunk and rank boundaries exactly."""
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        allowed &= k_pos[None, :] >= q_pos[:, None] - window[0]
    return allowed


def _finite(lse: Tensor) -> Tensor:
    """`lse` with −inf (a row with nothing to attend in this block) as 0, so exp(s − lse)
    gives 0 there instead of nan."""
    return lse.masked_fill(torch.isneginf(lse), 0.0)


def _block_forward(
    q: Tensor, k: Tensor, v: Tensor, scale: float, allowed: Tensor | None
) -> tuple[Tensor, Tensor]:
    """softmax(q kᵀ·scale) v and its log-sum-exp, fp32, heads layout [b, h, s, d];
    `allowed` bool [sq, sk] (True = attend) or None (every key)."""
    scores = torch.matmul(q, _expand_groups(k, q.shape[1]).transpose(-1, -2)) * scale
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - _finite(lse).unsqueeze(-1))
    return torch.matmul(probs, _expand_groups(v, q.shape[1])), lse


def _merge(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
    """Online-softmax merge of a block result into the running (out, lse), in place."""
    new_lse = torch.logaddexp(lse, block_lse)
    safe = _finite(new_lse)
    out.mul_(torch.exp(lse - safe).unsqueeze(-1)).add_(
        block_out * torch.exp(block_lse - safe).unsqueeze(-1)
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
    allowed: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of one block given the *final* out and log-sum-exp (flash-attention style)."""
    heads, groups = q.shape[1], k.shape[1]
    k_full, v_full = _expand_groups(k, heads), _expand_groups(v, heads)
    scores = torch.matmul(q, k_full.transpose(-1, -2)) * scale
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.exp(scores - lse.unsqueeze(-1))
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


class _Block:
    """What step `step` of the ring computes on cp rank r: which local query rows attend
    which rows of the key/value block that started on rank (r − step) mod C, and the mask
    (None: every pair). With the chunk layout an earlier rank's block is wholly visible
    in its first chunk, a later rank's to the second query half only; a sliding window
    then masks by global position, and a block it wholly hides is skipped."""

    def __init__(
        self,
        step: int,
        cp_rank: int,
        cp_size: int,
        local_length: int,
        window: tuple[int, int] | None,
        device: torch.device,
    ) -> None:
        half = local_length // 2
        source = _source(cp_rank, step, cp_size)
        if step == 0:
            self.rows, self.cols = slice(None), slice(None)
        elif source < cp_rank:
            self.rows, self.cols = slice(None), slice(0, half)
        else:
            self.rows, self.cols = slice(half, None), slice(None)
        self.allowed = None
        if step == 0 or window is not None:
            seq_length = local_length * cp_size
            q_pos = chunk_indices(seq_length, cp_rank, cp_size)[self.rows]
            k_pos = chunk_indices(seq_length, source, cp_size)[self.cols]
            self.allowed = block_mask(q_pos.to(device), k_pos.to(device), window)
        self.empty = window is not None and not bool(self.allowed.any())


class _RingAttention(torch.autograd.Function):
    """Causal load-balanced ring attention on [b, heads|groups, s_local, d] fp32 tensors.

    `sinks` [heads] (or None): each head's sink logit, which starts the running
    log-sum-exp, so it sits in every row's softmax denominator exactly once however
    many blocks merge into it; its gradient is −Σ p_sink·(dO·O) over the local rows
    (summed over the cp ranks with the other gradients)."""

    @staticmethod
    def forward(
        ctx,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        sinks: Tensor | None,
        scale: float,
        group,
        window: tuple[int, int] | None,
    ) -> Tensor:
        ring = _Ring(group)
        b, heads, s = q.shape[:3]
        out = torch.zeros_like(q)
        if sinks is None:
            lse = torch.full((b, heads, s), float("-inf"), dtype=q.dtype, device=q.device)
        else:
            lse = sinks.to(q.dtype).view(1, heads, 1).expand(b, heads, s).clone()
        kv = torch.stack([k, v])
        for step in range(ring.size):
            if step + 1 < ring.size:
                next_kv, requests = ring.start(kv)
            block = _Block(step, ring.rank, ring.size, s, window, q.device)
            if not block.empty:
                rows, cols = block.rows, block.cols
                block_out, block_lse = _block_forward(
                    q[:, :, rows], kv[0, :, :, cols], kv[1, :, :, cols], scale, block.allowed
                )
                _merge(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
            if step + 1 < ring.size:
                ring.wait(requests)
                kv = next_kv
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.scale, ctx.group, ctx.window = scale, group, window
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        scale, ring, window = ctx.scale, _Ring(ctx.group), ctx.window
        s = q.shape[2]
        grad_out = grad_out.contiguous()
        grad_q = torch.zeros_like(q)
        # kv block and its dk/dv accumulator travel together: [k, v, dk, dv]
        travelling = torch.stack([k, v, torch.zeros_like(k), torch.zeros_like(v)])
        for step in range(ring.size):
            block = _Block(step, ring.rank, ring.size, s, window, q.device)
            if not block.empty:
                rows, cols = block.rows, block.cols
                dq, dk, dv = _block_backward(
                    q[:, :, rows],
                    travelling[0, :, :, cols],
                    travelling[1, :, :, cols],
                    out[:, :, rows],
                    grad_out[:, :, rows],
                    lse[:, :, rows],
                    scale,
                    block.allowed,
                )
                grad_q[:, :, rows] += dq
                travelling[2, :, :, cols] += dk
                travelling[3, :, :, cols] += dv
            if ring.size > 1:
                # after the last step only dk/dv travel, one hop home to their owner
                payload = travelling if step + 1 < ring.size else travelling[2:].contiguous()
                received, requests = ring.start(payload)
                ring.wait(requests)
                if step + 1 < ring.size:
                    travelling = received
                else:
                    travelling = torch.cat([travelling[:2], received])
        grad_sinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            sink_probs = torch.exp(sinks.to(lse.dtype).view(1, -1, 1) - lse)
            grad_sinks = -(sink_probs * (grad_out * out).sum(-1)).sum((0, 2)).to(sinks.dtype)
        return grad_q, travelling[2], travelling[3], grad_sinks, None, None, None


def ring_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    group: dist.ProcessGroup,
    softmax_scale: float | None = None,
    sinks: Tensor | None = None,
    window_size: tuple[int, int] | None = None,
) -> Tensor:
    """Causal attention over a sequence sharded with `shard_sequence` across `group`.

    query [b, s_local, heads, d], key/value [b, s_local, groups, d] (GQA: heads a
    multiple of groups) → [b, s_local, heads·d], in the input dtype. Equals the
    local rows of full causal attention on the unsharded sequence. `sinks` [heads]:
    one extra logit per head in every softmax row (gpt-oss's attention sinks);
    `window_size` (left, 0): a sliding window over global positions."""
    b, s, heads, d = query.shape
    if s % 2:
        raise ContextParallelError(f"local sequence length {s} must be even (two chunks)")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    dv = value.shape[-1]
    if dv != d:  # MLA's narrower values: zero-padded to travel stacked with the keys
        value = F.pad(value, (0, d - dv))
    q, k, v = (t.transpose(1, 2).float() for t in (query, key, value))
    out = _RingAttention.apply(q, k, v, sinks, scale, group, window_size)[..., :dv]
    return out.to(query.dtype).transpose(1, 2).reshape(b, s, heads * dv)


# --- applying it to a model ------------------------------------------------------------------


class RingAttention(nn.Module):
    """Core-attention backend (mg.core.models.core_attention contract) for a cp group.

    Built from the core attention it replaces: that layer's softmax scale (MLA's with
    YaRN's mscale), sliding window and attention sinks; a learnable sink stays the
    same parameter, at the same name (`core_attention.softmax_offset`)."""

    def __init__(
        self, config: TransformerConfig, group: dist.ProcessGroup, replaced: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.group = group
        self.causal = True
        self.softmax_scale = getattr(replaced, "softmax_scale", config.attention_softmax_scale)
        self.dropout = config.attention_dropout
        self.window_size = getattr(replaced, "window_size", None)
        if self.window_size == (-1, -1):  # flash-attn's "no window"
            self.window_size = None
        self.softmax_type = getattr(replaced, "softmax_type", "vanilla")
        self.softmax_offset = getattr(replaced, "softmax_offset", None)

    @torch.no_grad()
    def init_weights(self, std: float) -> None:
        """Megatron inits the learnable sinks with init_method, N(0, σ)."""
        if self.softmax_offset is not None:
            nn.init.normal_(self.softmax_offset, mean=0.0, std=std)

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
        sinks = sink_logits(self, query.shape[2], query.device)
        return ring_attention(
            query, key, value, self.group, self.softmax_scale, sinks, self.window_size
        )


def apply_context_parallel(
    model: nn.Module, group: dist.ProcessGroup, tp_cp_group: dist.ProcessGroup | None = None
) -> nn.Module:
    """Swap every causal SDPA core-attention module of `model` for `RingAttention` in place.

    The model must then be fed `shard_batch`'d micro-batches (global position
    ids included). Sliding windows (masked by global position) and attention sinks
    (counted once per softmax row) go along; soft-capped logits and non-SDPA backends
    are refused: their ring variants do not exist here. `tp_cp_group`: the tensor ×
    context ranks of a sequence, for MoE layers whose tensor-parallel ranks route their
    own tokens (an expert tensor-parallel size below tp): their routers count the
    sequence's tokens over it."""
    if dist.get_world_size(group) == 1:
        return model
    config = getattr(model, "config", None)
    if config is None:
        raise ContextParallelError("apply_context_parallel needs a model with a .config")
    te = config.transformer_impl == "transformer_engine"
    if config.window_size is not None and te:
        raise ContextParallelError(
            "context parallelism with sliding-window attention (--window-size) and "
            "--transformer-impl transformer_engine: TE's p2p ring has no window here; "
            "use --transformer-impl local"
        )
    if config.attn_logit_softcapping is not None:
        raise ContextParallelError(
            "context parallelism does not support attention logit soft-capping "
            "(attn_logit_softcapping): the ring attention has no capped logits; "
            "use --context-parallel-size 1"
        )
    # the TE spec's attention becomes TE's DotProductAttention, told the cp group
    # (mg.core.models.te_parallel), whatever kernel the plain model picked
    ringable = (SDPAttention, FlashAttention) if te else SDPAttention
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
        module.core_attention = RingAttention(config, group, attention)
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
