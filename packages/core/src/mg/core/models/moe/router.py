"""The MoE router: which experts each token goes to, with what weight, and the balancing losses.

Megatron-Core's `TopKRouter` semantics (megatron/core/transformer/moe/router.py and
moe_utils.py, 0.16), written out as functions a reader can check by hand:

    logits  = x @ W_router.T (+ b)                       in moe_router_dtype (fp32/fp64) if set
    z-loss  = coeff · mean(logsumexp(logits)²)            (ST-MoE), attached to the logits
    softmax:   top-k of the logits, softmax over the k   (pre_softmax: softmax over all, then top-k)
    sigmoid:   top-k of sigmoid(logits) (+ expert_bias for the choice only), renormalised if k > 1
    probs  *= moe_router_topk_scaling_factor
    capacity:  each expert keeps at most ceil(T·k/E · factor) tokens, by probability or position
    aux loss:  E · coeff / (k · T²) · Σ_e (Σ_t score[t, e]) · tokens[e]   (Switch Transformer)

Tokens are rows in Megatron's [seq, batch] order: the sequence-level aux loss
reads them as [s, b·E]. The aux and z losses do not enter the forward value;
`AuxLossBackward` adds their gradient (times `AuxLossBackward.scale`, which the
training loop sets to 1/num_microbatches as Megatron's schedule does) when the
router's outputs are back-propagated. Their values, divided by the coefficient
as Megatron logs them, are kept in `router.losses` for the log line.

Process groups are plain attributes set from outside (None: this process
alone): `tp_cp_group` sums the token counts of a sequence split over
tensor/context-parallel ranks, `tp_dp_cp_group` those of the global aux loss
(Megatron's tensor × data × context group: every rank of a pipeline stage that routes
its own tokens). The global aux loss of a rank is then its tokens' part of the
micro-batch's loss over the whole group, logged summed over the group as Megatron does;
averaged over data-parallel ranks its gradient is 1/dp of that loss's, as in Megatron-LM
(its issue #3672): a run at DP = n equals one process with n times the micro-batch
and the coefficient / n.
"""

from __future__ import annotations

import math
from collections import deque

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from mg.core.models.config import TransformerConfig
from mg.core.models.local_tensor import local
from mg.core.models.recompute_state import checkpointed_forward, recomputing


class AuxLossBackward(torch.autograd.Function):
    """Identity on `output`; in backward, gives `aux_loss` the gradient `scale`.

    Megatron's `MoEAuxLossAutoScaler`: the aux loss is never added to the main
    loss, yet its gradient flows as if it had been (scaled like the main loss)."""

    scale: float = 1.0

    @staticmethod
    def forward(ctx, output: Tensor, aux_loss: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(aux_loss)
        return output

    @staticmethod
    def backward(ctx, grad_output: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(aux_loss, AuxLossBackward.scale)


class RandomLogits(torch.autograd.Function):
    """Standard-normal logits in place of the router's, the gradient passed straight through
    (Megatron's `RandomSTE`, `--moe-router-force-load-balancing`): balanced expert loads for
    benchmarks. The draw uses the default generator, which every tensor-parallel rank of a
    stage seeds alike, so they route their shared tokens alike."""

    @staticmethod
    def forward(ctx, logits: Tensor) -> Tensor:  # type: ignore[override]
        return torch.randn_like(logits)

    @staticmethod
    def backward(ctx, grad_output: Tensor) -> Tensor:  # type: ignore[override]
        return grad_output


def _group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _summed_over(counts: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Token counts summed over `group` (no gradient: counts are integers)."""
    if group is None or dist.get_world_size(group) == 1:
        return counts
    counts = counts.clone()
    dist.all_reduce(counts, group=group)
    return counts


def group_limited_topk(
    scores: Tensor, topk: int, num_groups: int, group_topk: int
) -> tuple[Tensor, Tensor]:
    """Top-k among the experts of the `group_topk` best groups (DeepSeek's device/node limit).

    A group's score is the sum of its best topk // group_topk expert scores."""
    tokens, experts = scores.shape
    grouped = scores.view(tokens, num_groups, experts // num_groups)
    group_scores = grouped.topk(topk // group_topk, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1).bool()
    expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(tokens, experts)
    return torch.topk(scores.masked_fill(~expert_mask, float("-inf")), k=topk, dim=-1)


def topk_routing(
    logits: Tensor,
    topk: int,
    *,
    score_function: str = "softmax",
    pre_softmax: bool = False,
    num_groups: int | None = None,
    group_topk: int | None = None,
    scaling_factor: float | None = None,
    expert_bias: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """logits [T, E] → (probs [T, E], zero off the routing map; routing_map [T, E] bool)."""

    def select(scores: Tensor) -> tuple[Tensor, Tensor]:
        if group_topk:
            return group_limited_topk(scores, topk, num_groups, group_topk)
        return torch.topk(scores, k=topk, dim=1)

    if score_function == "softmax":
        if pre_softmax:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
            probs, indices = select(scores)
        else:
            top_logits, indices = select(logits)
            probs = torch.softmax(top_logits, dim=-1, dtype=torch.float32).type_as(logits)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits.float()).type_as(logits)
        if expert_bias is not None:  # the bias steers the choice, not the weights
            _, indices = select(scores + expert_bias)
            scores = torch.gather(scores, dim=1, index=indices).type_as(logits)
        else:
            scores, indices = select(scores)
        probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20) if topk > 1 else scores
    else:
        raise ValueError(f"unknown moe_router_score_function {score_function!r}")
    if scaling_factor:
        probs = probs * scaling_factor
    routing_probs = torch.zeros_like(logits).scatter(1, indices, probs)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)
    return routing_probs, routing_map


def sinkhorn(cost: Tensor, tol: float = 1e-4) -> Tensor:
    """Sinkhorn-Knopp balancing of exp(cost) (BASE layers), as Megatron iterates it."""
    cost = torch.exp(cost)
    d0 = torch.ones(cost.size(0), device=cost.device, dtype=cost.dtype)
    d1 = torch.ones(cost.size(1), device=cost.device, dtype=cost.dtype)
    eps = 1e-8
    error = 1e9
    d1_old = d1
    while error > tol:
        d0 = (1 / d0.size(0)) * 1 / (torch.sum(d1 * cost, 1) + eps)
        d1 = (1 / d1.size(0)) * 1 / (torch.sum(d0.unsqueeze(1) * cost, 0) + eps)
        error = torch.mean(torch.abs(d1_old - d1))
        d1_old = d1
    return d1 * cost * d0.unsqueeze(1)


def expert_capacity(num_tokens: int, num_experts: int, topk: int, capacity_factor: float) -> int:
    """Tokens an expert takes at most: ceil(T·k / E · factor) (Megatron's `get_capacity`)."""
    return math.ceil(num_tokens * topk / num_experts * capacity_factor)


def drop_to_capacity(
    probs: Tensor,
    routing_map: Tensor,
    topk: int,
    capacity_factor: float,
    drop_policy: str = "probs",
    pad_to_capacity: bool = False,
) -> tuple[Tensor, Tensor]:
    """Keep each expert's `expert_capacity` tokens: the most probable ("probs") or the
    first in token order ("position"); with `pad_to_capacity` every expert gets exactly
    capacity rows (filled with tokens of weight 0), so shapes are static."""
    num_tokens, num_experts = probs.shape
    capacity = expert_capacity(num_tokens, num_experts, topk, capacity_factor)
    if capacity > num_tokens:
        keep = torch.ones_like(routing_map)
    elif drop_policy == "probs":
        chosen = torch.topk(probs, k=capacity, dim=0, sorted=False)[1]
        keep = torch.zeros_like(routing_map).scatter(0, chosen, True)
    elif drop_policy == "position":
        # routed tokens first, each group in token order (a stable sort), then the first capacity
        order = torch.sort(routing_map.int(), dim=0, descending=True, stable=True)[1]
        keep = torch.zeros_like(routing_map).scatter(0, order[:capacity], True)
    else:
        raise ValueError(f"unknown moe_token_drop_policy {drop_policy!r}")
    final_map = keep if pad_to_capacity else routing_map & keep
    return probs * final_map, final_map


def switch_load_balancing_loss(
    scores: Tensor,
    tokens_per_expert: Tensor,
    total_num_tokens: float,
    topk: int,
    num_experts: int,
    coeff: float,
) -> Tensor:
    """E · coeff / (k · T²) · Σ_e (Σ_t scores[t, e]) · tokens_per_expert[e]."""
    per_expert = scores.sum(dim=0)
    return torch.sum(per_expert * tokens_per_expert) * (
        num_experts * coeff / (topk * total_num_tokens * total_num_tokens)
    )


def z_loss(logits: Tensor, coeff: float) -> Tensor:
    """coeff · mean over tokens of logsumexp(logits)² (ST-MoE router z-loss)."""
    return torch.mean(torch.square(torch.logsumexp(logits, dim=-1))) * coeff


def scores_for_aux_loss(logits: Tensor, topk: int, score_function: str) -> tuple[Tensor, Tensor]:
    """The plain top-k map and normalised scores the aux losses use (no bias, no groups)."""
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        scores = torch.sigmoid(logits)
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    indices = torch.topk(scores, k=topk, dim=1)[1]
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)
    return routing_map, scores


_AUX_LOSS_NAMES = {
    "aux_loss": "load_balancing_loss",
    "seq_aux_loss": "seq_load_balancing_loss",
    "global_aux_loss": "global_load_balancing_loss",
}


class TopKRouter(nn.Module):
    """Linear gate [E, h] (+ bias with add_bias_linear) and top-k routing.

    `expert_bias` (a persistent buffer, Megatron's name) exists with
    moe_router_enable_expert_bias; `update_expert_bias` moves it once per step
    from the token counts this router saw (`local_tokens_per_expert`)."""

    def __init__(self, config: TransformerConfig, layer_number: int = 1) -> None:
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        self.num_experts = config.num_moe_experts
        self.topk = config.moe_router_topk
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size))
        self.bias = nn.Parameter(torch.empty(self.num_experts)) if config.add_bias_linear else None
        if config.moe_router_enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(self.num_experts))
            self.register_buffer(
                "local_tokens_per_expert", torch.zeros(self.num_experts), persistent=False
            )
        else:
            self.expert_bias = None
            self.local_tokens_per_expert = None
        if config.moe_router_load_balancing_type == "global_aux_loss":
            self.register_buffer(
                "global_tokens_per_expert", torch.zeros(self.num_experts), persistent=False
            )
            self.register_buffer("ga_steps", torch.zeros(()), persistent=False)
        self.tp_cp_group: dist.ProcessGroup | None = None
        self.tp_dp_cp_group: dist.ProcessGroup | None = None
        self.losses: dict[str, Tensor] = {}
        """The last forward's balancing losses, divided by their coefficient (for logging)."""
        self._loss_sums: dict[str, Tensor] = {}
        self._loss_counts: dict[str, int] = {}
        self._replay: deque[Tensor] = deque()
        """Global aux loss under recompute: the averaged counts each checkpointed forward
        used, for its recomputation (micro-batches are recomputed in forward order)."""

    @torch.no_grad()
    def init_weights(self, std: float) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=std)
        if self.bias is not None:
            nn.init.normal_(self.bias, mean=0.0, std=std)  # Megatron inits it like the weight
        if self.expert_bias is not None:
            self.expert_bias.zero_()
            self.local_tokens_per_expert.zero_()
        self.reset_global_aux_loss_tracker()  # a model materialised from meta: empty memory

    def gating(self, tokens: Tensor) -> Tensor:
        dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(
            self.config.moe_router_dtype, tokens.dtype
        )
        bias = None if self.bias is None else local(self.bias).to(dtype)
        return F.linear(tokens.to(dtype), local(self.weight).to(dtype), bias)

    def forward(self, tokens: Tensor, seq_length: int) -> tuple[Tensor, Tensor]:
        """tokens [T, h] in [s, b] order → (probs [T, E], routing_map [T, E])."""
        c = self.config
        replay = recomputing()  # a recomputation: the forward's statistics are counted
        losses, self.losses = self.losses, {}
        logits = self.gating(tokens)
        if c.moe_router_force_load_balancing:
            logits = RandomLogits.apply(logits)
        training = self.training and torch.is_grad_enabled()
        if c.moe_z_loss_coeff is not None and training:
            coeff = c.moe_z_loss_coeff / _group_size(self.tp_cp_group)
            loss = z_loss(logits, coeff)
            logits = AuxLossBackward.apply(logits, loss)
            self.losses["z_loss"] = loss.detach() / coeff

        if c.moe_router_load_balancing_type == "sinkhorn":
            probs, routing_map = self._sinkhorn_routing(logits)
        else:
            probs, routing_map = topk_routing(
                logits,
                self.topk,
                score_function=c.moe_router_score_function,
                pre_softmax=c.moe_router_pre_softmax,
                num_groups=c.moe_router_num_groups,
                group_topk=c.moe_router_group_topk,
                scaling_factor=c.moe_router_topk_scaling_factor,
                expert_bias=self.expert_bias,
            )
        if c.moe_expert_capacity_factor is not None:
            probs, routing_map = drop_to_capacity(
                probs,
                routing_map,
                self.topk,
                c.moe_expert_capacity_factor,
                c.moe_token_drop_policy,
                c.moe_pad_expert_input_to_capacity,
            )
        kind = c.moe_router_load_balancing_type
        if training and kind in _AUX_LOSS_NAMES and c.moe_aux_loss_coeff > 0:
            probs = self._attach_aux_loss(probs, logits, kind, seq_length)
        if replay:  # counted by the forward this recomputes
            self.losses = losses
            return probs, routing_map
        if self.expert_bias is not None and torch.is_grad_enabled():
            self.local_tokens_per_expert += routing_map.sum(dim=0)
        for name, value in self.losses.items():
            self._loss_sums[name] = self._loss_sums.get(name, 0.0) + value
            self._loss_counts[name] = self._loss_counts.get(name, 0) + 1
        return probs, routing_map

    def pop_losses(self) -> dict[str, Tensor]:
        """Each balancing loss averaged over the forwards since the last call (a training
        step's micro-batches), as Megatron logs them; starts a new window."""
        out = {name: total / self._loss_counts[name] for name, total in self._loss_sums.items()}
        self._loss_sums, self._loss_counts = {}, {}
        return out

    def _sinkhorn_routing(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        def activation(x: Tensor) -> Tensor:
            if self.topk == 1:
                return torch.sigmoid(x)
            return torch.softmax(x, dim=-1, dtype=torch.float32).type_as(x)

        if self.training:
            with torch.no_grad():
                indices = torch.topk(sinkhorn(logits.float()), k=self.topk, dim=1)[1]
            scores = activation(logits)
        else:
            scores = activation(logits)
            indices = torch.topk(scores, k=self.topk, dim=1)[1]
        routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)
        return scores * routing_map, routing_map

    def _attach_aux_loss(self, probs: Tensor, logits: Tensor, kind: str, seq_length: int) -> Tensor:
        c = self.config
        coeff = c.moe_aux_loss_coeff
        aux_map, scores = scores_for_aux_loss(logits, self.topk, c.moe_router_score_function)
        if kind == "seq_aux_loss":  # one loss per sequence: rows [s], columns [b · E]
            batch = aux_map.shape[0] // seq_length
            aux_map = aux_map.reshape(seq_length, -1)
            scores = scores.reshape(seq_length, -1)
        group = self.tp_dp_cp_group if kind == "global_aux_loss" else self.tp_cp_group
        tokens_per_expert = _summed_over(aux_map.sum(dim=0).to(scores.dtype), group)
        total_tokens = aux_map.shape[0] * _group_size(group)
        if kind == "global_aux_loss" and recomputing():  # the counts its forward used
            tokens_per_expert = self._replay.popleft()
        elif kind == "global_aux_loss":  # counts averaged over the steps since the last reset
            self.global_tokens_per_expert += tokens_per_expert
            self.ga_steps += 1
            tokens_per_expert = self.global_tokens_per_expert / self.ga_steps
            if checkpointed_forward():
                self._replay.append(tokens_per_expert.clone())
        loss = switch_load_balancing_loss(
            scores, tokens_per_expert, total_tokens, self.topk, self.num_experts, coeff
        )
        if kind == "seq_aux_loss":
            loss = loss / batch
        if not recomputing():  # a sequence split over TP/CP ranks: each its tokens' part
            # (the global loss: the parts of every rank whose counts it sums, as Megatron logs)
            logged = _summed_over(loss.detach(), group) / coeff
            self.losses[_AUX_LOSS_NAMES[kind]] = logged
        return AuxLossBackward.apply(probs, loss)

    @torch.no_grad()
    def update_expert_bias(self, group: dist.ProcessGroup | None = None) -> None:
        """Aux-loss-free balancing (DeepSeek-V3): bias += rate · sign(mean count − count),
        counts summed over `group` (Megatron: tensor × data × context parallel ranks)."""
        if self.expert_bias is None:
            return
        counts = _summed_over(self.local_tokens_per_expert, group)
        offset = counts.mean() - counts
        self.expert_bias += torch.sign(offset) * self.config.moe_router_bias_update_rate
        self.local_tokens_per_expert.zero_()

    def reset_global_aux_loss_tracker(self) -> None:
        """Start a new averaging window for the global aux loss (Megatron: every step)."""
        self._replay.clear()  # recomputations not run (a forward without backward)
        if self.config.moe_router_load_balancing_type == "global_aux_loss":
            self.global_tokens_per_expert.zero_()
            self.ga_steps.zero_()
