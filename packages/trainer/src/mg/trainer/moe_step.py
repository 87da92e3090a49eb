"""What a training step does for MoE layers besides forward and backward (Megatron's loop).

- Before the micro-batches: the aux/z-loss gradient is scaled like the main loss,
  `loss_scale / num_microbatches` (`MoEAuxLossAutoScaler.set_loss_scale`).
- After them: the aux-loss-free expert biases move by the step's token counts
  summed over data-parallel ranks, the global aux loss's averaging window
  restarts, and each balancing loss (averaged over micro-batches and MoE
  layers, then over ranks) goes to the log line and tensorboard under
  Megatron's names (`load_balancing_loss`, `z_loss`, ...).

A dense model makes every function here a no-op.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from mg.core.models import TransformerConfig
from mg.core.models.moe import AuxLossBackward, TopKRouter

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


def begin_step(num_micro: int, loss_scale: float) -> None:
    AuxLossBackward.scale = loss_scale / max(num_micro, 1)


def finish_step(
    model: nn.Module, config: TransformerConfig, dp_group: dist.ProcessGroup | None
) -> dict[str, float]:
    """Expert-bias update and window reset; returns the step's balancing losses.

    Every rank takes part in the reduction, also a pipeline stage without MoE layers."""
    if config.num_moe_experts is None:
        return {}
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    names = logged_losses(config)
    totals = torch.zeros(2 * len(names), dtype=torch.float64)
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    for router in routers:
        router.update_expert_bias(dp_group if distributed else None)
        router.reset_global_aux_loss_tracker()
        losses = router.pop_losses()
        for i, name in enumerate(names):
            if name in losses:
                totals[2 * i] += float(losses[name])
                totals[2 * i + 1] += 1
    if not names:
        return {}
    if distributed:  # per loss: sum over layers and their count, over every rank
        device = next(model.parameters()).device
        moved = totals.to(device)
        dist.all_reduce(moved)
        totals = moved.cpu()
    return {n: float(totals[2 * i] / totals[2 * i + 1].clamp(min=1)) for i, n in enumerate(names)}
