"""What Megatron's optional logging flags add to each iteration's log.

- `--log-params-norm`: the parameters' L2 norm (`mg.trainer.param_stats`),
  `params norm` on the log line and `params-norm` in tensorboard/wandb;
- `--log-num-zeros-in-grad`: the zero gradient elements, `num zeros` / `num-zeros`
  (none for an iteration whose step was skipped, as Megatron);
- `--log-timers-to-tensorboard`: `<name>-time` at each log line (`mg.trainer.step_timers`);
- `--log-memory-to-tensorboard`: the memory figures every iteration (`mg.trainer.memory_stats`).

Every rank calls `after_step` (the sums are collectives); the metrics writer keeps
rank 0's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mg.core.parallel.layout import ParallelLayout
from mg.trainer.arguments import Args
from mg.trainer.housekeeping import Housekeeping
from mg.trainer.memory_stats import memory_scalars
from mg.trainer.param_stats import num_zeros_in_grads, params_l2_norm
from mg.trainer.step_timers import StepTimers, TimedHousekeeping


class StepStats:
    """The four flags' figures for one run; `after_step` once per iteration."""

    def __init__(
        self,
        args: Args,
        layout: ParallelLayout,
        model: nn.Module,
        optimizer: Any,
        device: torch.device,
    ) -> None:
        lg = args.logging
        self.log_params_norm, self.log_num_zeros = lg.log_params_norm, lg.log_num_zeros_in_grad
        self.log_memory, self.log_interval = lg.log_memory_to_tensorboard, lg.log_interval
        self.layout, self.model, self.optimizer, self.device = layout, model, optimizer, device
        self.timers = StepTimers(device) if lg.log_timers_to_tensorboard else None
        self.params_norm: float | None = None
        self.num_zeros: int | None = None

    def timed(self, housekeeping: Housekeeping) -> Housekeeping | TimedHousekeeping:
        """The housekeeping hooks, timing the step under --log-timers-to-tensorboard."""
        return housekeeping if self.timers is None else TimedHousekeeping(housekeeping, self.timers)

    def after_step(self, iteration: int, stepped: bool) -> dict[str, float]:
        """This iteration's figures (after its optimizer step): the tensorboard scalars."""
        scalars: dict[str, float] = {}
        self.params_norm = self.num_zeros = None
        if self.log_num_zeros and stepped:
            self.num_zeros = num_zeros_in_grads(self.model, self.optimizer, self.layout)
            scalars["num-zeros"] = self.num_zeros
        if self.log_params_norm:
            self.params_norm = params_l2_norm(self.model, self.optimizer, self.layout)
            scalars["params-norm"] = self.params_norm
        if self.timers is not None and iteration % self.log_interval == 0:
            scalars |= self.timers.scalars()
        if self.log_memory:
            scalars |= memory_scalars(self.device)
        return scalars

    def line_fields(self) -> dict[str, Any]:
        """`training_log_line`'s `num_zeros` and `params_norm` (None: not printed)."""
        return {"num_zeros": self.num_zeros, "params_norm": self.params_norm}
