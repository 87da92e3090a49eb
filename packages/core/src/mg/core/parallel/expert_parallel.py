"""Expert parallelism: each rank keeps E/ep of every MoE layer's experts, tokens travel.

`apply_expert_parallel(model, layout, dispatcher)` works on a built model
(mg.core.models.moe layers, all experts present, e.g. the single-process
initialisation): in each `MoELayer` it keeps the experts of this rank's
expert-parallel position — rank r of the group holds experts r·E/ep …
(r+1)·E/ep − 1, renumbered from 0 (`local_experts.0`, `weight0`) as
Megatron-Core names a rank's local experts — and installs a token dispatcher
holding the layout's expert-parallel group ("alltoall" or "allgather").

The groups are Megatron-Core's (`parallel_state.initialize_model_parallel`):
expert ranks are ordered tp-ep-dp-pp with the expert tensor-parallel size
(`etp`, default tp) in place of tp, so

    rank = etp_rank + etp · (ep_rank + ep · (expert_dp_rank + expert_dp · pp_rank))

and etp · ep · expert_dp = tp · cp · dp: the expert-parallel ranks are drawn
from the ranks that hold the same pipeline stage. With etp = 1 and tp > 1 the
tensor-parallel ranks become expert-parallel ranks for the experts.

Gradients: a rank's expert weights see the tokens of every rank in its
expert-parallel group, so they are not averaged over that group; they are
averaged over the expert data-parallel group instead (`expert_grad_group`),
with the same 1/dp scale as the dense weights (Megatron's
`expert_gradient_scaling_factor`).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch.distributed as dist
from torch import nn

from mg.core.models.moe import AllGatherDispatcher, AllToAllDispatcher, MoELayer


class ExpertParallelError(ValueError):
    """An expert-parallel layout that does not fit the model; names the flags."""


def expert_rank_groups(
    world_size: int, *, tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None
) -> dict[str, list[list[int]]]:
    """Every expert group of the world, Megatron's: "ep", "etp", "edp" and "etp_ep"
    (the expert tensor × expert parallel ranks), each a list of rank lists."""
    etp = tp if etp is None else etp
    per_stage = world_size // pp
    if world_size % pp or per_stage % (etp * ep):
        raise ExpertParallelError(
            f"--expert-model-parallel-size ({ep}) × --expert-tensor-parallel-size ({etp}) "
            f"must divide the ranks of a pipeline stage ({per_stage}: world size {world_size} / "
            f"pipeline size {pp})"
        )
    edp = per_stage // (etp * ep)

    def rank(t: int, e: int, d: int, p: int) -> int:
        return t + etp * (e + ep * (d + edp * p))

    groups: dict[str, list[list[int]]] = {"ep": [], "etp": [], "edp": [], "etp_ep": []}
    for p in range(pp):
        for d in range(edp):
            for t in range(etp):
                groups["ep"].append([rank(t, e, d, p) for e in range(ep)])
            for e in range(ep):
                groups["etp"].append([rank(t, e, d, p) for t in range(etp)])
            groups["etp_ep"].append([rank(t, e, d, p) for e in range(ep) for t in range(etp)])
        for e in range(ep):
            for t in range(etp):
                groups["edp"].append([rank(t, e, d, p) for d in range(edp)])
    return groups


def moe_layers(model: nn.Module) -> Iterator[MoELayer]:
    return (m for m in model.modules() if isinstance(m, MoELayer))


def apply_expert_parallel(
    model: nn.Module,
    ep_group: dist.ProcessGroup | None,
    dispatcher: str = "alltoall",
    *,
    experts_apart: bool = False,
) -> nn.Module:
    """Keep this rank's experts in every MoE layer and dispatch tokens over `ep_group`.

    A group of None or size 1 leaves the experts whole and installs the
    dispatcher without communication. `experts_apart` marks the experts'
    parameters as expert-parallel ones at ep = 1 too (an expert tensor-parallel
    size below TP: each expert tensor-parallel group's experts see other tokens,
    so their gradients are reduced over the expert data-parallel group)."""
    ep = 1 if ep_group is None else dist.get_world_size(ep_group)
    ep_rank = 0 if ep_group is None else dist.get_rank(ep_group)
    for layer in moe_layers(model):
        num_experts = layer.config.num_moe_experts
        if num_experts % ep:
            raise ExpertParallelError(
                f"--num-experts ({num_experts}) is not divisible by "
                f"--expert-model-parallel-size ({ep})"
            )
        if ep == 1:
            for param in layer.experts.parameters():
                if experts_apart:
                    param.allreduce = False
            continue
        local = num_experts // ep
        layer.experts.keep_experts(range(ep_rank * local, (ep_rank + 1) * local))
        layer.experts.expert_offset = ep_rank * local  # its experts' global numbers (checkpoints)
        if dispatcher == "alltoall":
            layer.token_dispatcher = AllToAllDispatcher(num_experts, ep_group)
        elif dispatcher == "allgather":
            layer.token_dispatcher = AllGatherDispatcher(num_experts, ep_group)
        else:
            raise ExpertParallelError(
                f"--moe-token-dispatcher-type {dispatcher!r} is not one of alltoall, allgather"
            )
        for param in layer.experts.parameters():
            param.allreduce = False  # Megatron's mark: reduced over the expert-DP group only
    return model


def is_expert_parameter(param: nn.Parameter) -> bool:
    """True for a routed expert's weight under expert parallelism (Megatron's allreduce=False)."""
    return getattr(param, "allreduce", True) is False
