"""The MoE layer a decoder layer uses in place of its MLP (Megatron-Core's `MoELayer`).

Read top to bottom:

    tokens  = x as rows [s·b, h] in Megatron's [seq, batch] order
    probs, routing_map = router(tokens)                 which experts, what weight
    rows, tokens_per_expert, row_probs, handle = dispatcher.dispatch(tokens, probs, routing_map)
    out     = dispatcher.combine(experts(rows, tokens_per_expert, row_probs), handle)
    out    += shared_experts(tokens)                    when configured
    return out as [b, s, h]

State-dict names are Megatron-Core's: `router.weight`, `router.expert_bias`,
`experts.local_experts.{e}.linear_fc1.weight` (sequential) or
`experts.linear_fc1.weight{e}` (moe_grouped_gemm), `shared_experts.linear_fc1.weight`,
`shared_experts.gate_weight`. The layer holds every expert and communicates
nothing; `mg.core.parallel.expert_parallel` keeps a rank's experts and swaps in
a dispatcher with the expert-parallel group, and `mg.core.models.moe.tensor_parallel`
gives it its expert tensor-parallel group (the ranks that gather their tokens, route
them alike and split the experts: TP, a part of it, or none at expert-tensor-parallel
size 1) and, where that is not all of TP, the shared experts' TP group.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor, nn

from mg.core.models.config import TransformerConfig
from mg.core.models.moe.dispatcher import AllGatherDispatcher
from mg.core.models.moe.experts import GroupedMLP, SequentialMLP, SharedExpertMLP
from mg.core.models.moe.router import TopKRouter
from mg.core.models.moe.tensor_parallel import enter_region, leave_region


class MoELayer(nn.Module):
    """Router + token dispatcher + routed experts (+ shared experts)."""

    def __init__(self, config: TransformerConfig, layer_number: int = 1) -> None:
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        self.router = TopKRouter(config, layer_number)
        experts = GroupedMLP if config.moe_grouped_gemm else SequentialMLP
        self.experts = experts(config, config.num_moe_experts)
        self.shared_experts = (
            SharedExpertMLP(config) if config.moe_shared_expert_intermediate_size else None
        )
        self.token_dispatcher = AllGatherDispatcher(config.num_moe_experts)
        self.etp_group: dist.ProcessGroup | None = None  # set by shard_moe_layer
        self.shared_experts_tp_group: dist.ProcessGroup | None = None  # ditto, etp < tp
        self.sequence_parallel = False

    def init_weights(self, std: float, output_std: float) -> None:
        """Router, then the experts in order, then the shared experts (Megatron's build order)."""
        self.router.init_weights(std)
        self.experts.init_weights(std, output_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(std, output_std)

    def forward(self, hidden: Tensor) -> Tensor:
        own = hidden  # [b, s/tp, h] under sequence parallelism
        if self.etp_group is not None:  # the group's tokens on each of its ranks
            hidden = enter_region(hidden, self.etp_group, self.sequence_parallel)
        b, s, h = hidden.shape
        tokens = hidden.transpose(0, 1).reshape(s * b, h)
        shared = own_shared = None
        if self.shared_experts_tp_group is not None:  # etp < tp: split over TP themselves
            own_shared = self._shared_experts_over_tp(own)
        elif self.shared_experts is not None:
            shared = self.shared_experts(tokens)
        probs, routing_map = self.router(tokens, seq_length=s)
        rows, tokens_per_expert, row_probs, handle = self.token_dispatcher.dispatch(
            tokens, probs, routing_map
        )
        out = self.experts(rows, tokens_per_expert, row_probs)
        out = self.token_dispatcher.combine(out, handle).to(hidden.dtype)
        if shared is not None:
            out = out + shared
        out = out.view(s, b, h).transpose(0, 1)
        if self.etp_group is not None:
            out = leave_region(out, self.etp_group, self.sequence_parallel)
        if own_shared is not None:
            out = out + own_shared
        return out

    def _shared_experts_over_tp(self, hidden: Tensor) -> Tensor | None:
        """The shared experts as Megatron's tensor-parallel MLP on the gathered sequence,
        this rank's slice of their output [b, s/tp, h]."""
        if self.shared_experts is None:
            return None
        group = self.shared_experts_tp_group
        full = enter_region(hidden, group, self.sequence_parallel)
        b, s, h = full.shape
        out = self.shared_experts(full.transpose(0, 1).reshape(s * b, h))
        return leave_region(out.view(s, b, h).transpose(0, 1), group, self.sequence_parallel)
