"""What a training step does for MoE layers besides forward and backward (Megatron's loop).

- Before the micro-batches: the aux/z-loss gradient is scaled like the main loss,
  `loss_scale / num_microbatches` (`MoEAuxLossAutoScaler.set_loss_scale`).
- After them: the aux-loss-free expert biases move by the step's token counts
  summed over data-parallel ranks, the global aux loss's averaging window
  restarts, and each balancing loss (averaged over micro-batches and MoE
  layers, then over ranks) goes to the log line and tensorboard under
  Megatron's names (`load_balancing_loss`, `z_loss`, ...); with
  --moe-per-layer-logging each layer's also to tensorboard
  (`moe/load_balancing_loss_layer_3`; 0 for a dense layer, as in Megatron).

A dense model makes every function here a no-op.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from mg.core.models import TransformerConfig
from mg.core.models.moe import AuxLossBackward, TopKRouter
from mg.core.parallel.expert_parallel import is_expert_parameter
from mg.core.parallel.grad_norm import global_grad_norm
from mg.core.parallel.layout import ParallelLayout
from mg.core.parallel.pipeline import is_shared_copy

_AUX_NAMES = {
    "aux_loss": "load_balancing_loss",
    "seq_aux_loss": "seq_load_balancing_loss",
    "global_aux_loss": "global_load_balancing_loss",
}


def logged_losses(config: TransformerConfig) -> list[str]:
    """The balancing losses an MoE config reports, in log order."""
    if config.num_moe_experts is None:
        return []
    names = []
    aux = _AUX_NAMES.get(config.moe_router_load_balancing_type)
    if aux and config.moe_aux_loss_coeff > 0:
        names.append(aux)
    if config.moe_z_loss_coeff is not None:
        names.append("z_loss")
    return names


def begin_step(num_micro: int, loss_scale: float, layout: ParallelLayout | None = None) -> None:
    """Under tensor parallelism with experts split over TP every TP rank computes the same
    balancing losses and their input gradients are summed over TP
    (mg.core.models.moe.tensor_parallel): 1/tp each. With an expert-tensor-parallel size
    below TP each rank's losses are its tokens' part (1/etp of its expert tensor-parallel
    group's chunk's, counted over TP): no division. Under context parallelism
    each rank's losses are its chunks' part and gradients are averaged over cp: times cp,
    as the main loss (Megatron's `loss_scale * cp_group_size / num_microbatches`)."""
    layout = layout or ParallelLayout()
    tp = 1 if layout.etp != layout.tp else layout.tp
    AuxLossBackward.scale = loss_scale * layout.cp / max(num_micro, 1) / tp


def finish_step(
    model: nn.Module,
    config: TransformerConfig,
    dp_group: dist.ProcessGroup | None,
    per_layer: bool = False,
) -> tuple[dict[str, float], dict[str, float]]:
    """Expert-bias update and window reset; returns the step's balancing losses, and with
    `per_layer` (--moe-per-layer-logging) each layer's under Megatron's tensorboard name
    `moe/{loss}_layer_{i}` (i: the layer's 0-based number in the model; 0 for a dense
    layer, as Megatron writes them).

    `dp_group`: the ranks whose token counts the expert bias sums (data × context, or every
    rank of the stage when each tensor-parallel rank routes its own tokens). Every rank
    takes part in the reduction, also a pipeline stage without MoE layers."""
    if config.num_moe_experts is None:
        return {}, {}
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    names = logged_losses(config)
    # per loss: [sum, count] over all layers, then [sum, count] of each layer (MTP layers
    # numbered after the decoder's, as Megatron's tracker counts them)
    num_layers = config.num_layers + (getattr(config, "mtp_num_layers", None) or 0)
    totals = torch.zeros(len(names), 1 + num_layers, 2, dtype=torch.float64)
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    for router in routers:
        router.update_expert_bias(dp_group if distributed else None)
        router.reset_global_aux_loss_tracker()
        losses = router.pop_losses()
        for i, name in enumerate(names):
            if name in losses:
                value = float(losses[name])
                totals[i, 0] += torch.tensor([value, 1.0], dtype=torch.float64)
                totals[i, router.layer_number] += torch.tensor([value, 1.0], dtype=torch.float64)
    if not names:
        return {}, {}
    if distributed:  # sums and counts over every rank
        device = next(model.parameters()).device
        moved = totals.to(device)
        dist.all_reduce(moved)
        totals = moved.cpu()
    mean = totals[..., 0] / totals[..., 1].clamp(min=1)
    losses = {name: float(mean[i, 0]) for i, name in enumerate(names)}
    layers: dict[str, float] = {}
    if per_layer:  # every layer, as Megatron's tracker holds them: 0 for a dense one
        for i, name in enumerate(names):
            for number in range(1, num_layers + 1):
                layers[f"moe/{name}_layer_{number - 1}"] = float(mean[i, number])
    return losses, layers


def allreduce_expert_gradients(model: nn.Module, layout: ParallelLayout) -> None:
    """Expert-parallel experts' gradients summed over their replicas (expert-DP group) and
    scaled 1/dp like the dense ones (Megatron's expert_gradient_scaling_factor): a rank's
    experts already hold the gradient of every token its EP group routed to them."""
    if not layout.experts_apart:
        return
    grads = [
        p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad  # TP: this rank's slices
        for p in model.parameters()
        if p.grad is not None and is_expert_parameter(p)
    ]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    if layout.expert_dp > 1:
        dist.all_reduce(flat, group=layout.expert_dp_group)
    flat /= layout.dp * layout.cp
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def clip_grad_norm_expert_parallel(
    params: list[nn.Parameter], clip_grad: float, layout: ParallelLayout
) -> float:
    """The global L2 norm with expert parallelism: the dense gradients (the same on every
    rank of a stage) plus every rank's own experts, summed over the EP group, then over
    the pipeline stages (the tied embedding's last-stage copy counted once); clipped if
    clip > 0, every rank by the same coefficient (Megatron's `clip_grad_norm_fp32`)."""
    grads = [p for p in params if p.grad is not None]
    dense = [p.grad for p in grads if not is_expert_parameter(p) and not is_shared_copy(p)]
    experts = [p.grad for p in grads if is_expert_parameter(p)]
    local = grads[0].grad.to_local() if isinstance(grads[0].grad, DTensor) else grads[0].grad
    # tensor-parallel slices summed over TP (global_grad_norm), then the EP group's experts
    expert_sq = torch.tensor(
        global_grad_norm(experts) ** 2, dtype=torch.float64, device=local.device
    )
    dist.all_reduce(expert_sq, group=layout.ep_group)
    total_sq = global_grad_norm(dense) ** 2 + expert_sq
    if layout.pp > 1:  # each stage its own layers
        dist.all_reduce(total_sq, group=layout.pp_group)
    total = float(total_sq.sqrt())
    if not math.isfinite(total):
        return float("nan")
    if clip_grad > 0 and total > clip_grad:
        scale = clip_grad / (total + 1e-6)  # torch.nn.utils.clip_grad_norm_'s coefficient
        for p in grads:
            p.grad.mul_(scale)
    return total
