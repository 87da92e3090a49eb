"""fp16 loss scaling (Megatron's DynamicGradScaler) and what bf16 means here.

Precision design (the simplest correct one): parameters, gradients and the
optimizer state stay fp32; `--bf16` / `--fp16` run the forward under
`torch.autocast` in that dtype. bf16 needs no scaling. fp16 multiplies the loss
by a scale before backward; after backward the gradients are unscaled and, if
any is inf/NaN, the step is skipped and counted. Megatron keeps bf16/fp16
parameters with fp32 main copies instead, which saves memory but computes the
same update; that can come with the distributed optimizer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor


class ConstantLossScaler:
    """Scale 1 (fp32/bf16) or a fixed `--loss-scale`: no skipping logic beyond inf checks."""

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = float(scale)

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])


class DynamicLossScaler(ConstantLossScaler):
    """Megatron's DynamicGradScaler: halve after `hysteresis` overflows, double after
    `growth_interval` clean steps, never below `min_scale`."""

    def __init__(
        self,
        initial_scale: float = 2.0**32,
        min_scale: float = 1.0,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
    ) -> None:
        super().__init__(initial_scale)
        self.min_scale = min_scale
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self._growth_tracker = 0
        self._hysteresis_tracker = hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self.scale = self.scale * self.growth_factor

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self._growth_tracker = int(state["growth_tracker"])
        self._hysteresis_tracker = int(state["hysteresis_tracker"])


def build_loss_scaler(
    fp16: bool,
    loss_scale: float | None,
    initial_loss_scale: float,
    min_loss_scale: float,
    loss_scale_window: int,
    hysteresis: int,
) -> ConstantLossScaler:
    """Dynamic scaling for fp16 unless `--loss-scale` fixes it; scale 1 otherwise."""
    if not fp16:
        return ConstantLossScaler(1.0)
    if loss_scale is not None:
        return ConstantLossScaler(loss_scale)
    return DynamicLossScaler(initial_loss_scale, min_loss_scale, loss_scale_window, hysteresis)


def unscale_and_check(params: list[torch.nn.Parameter], scale: float) -> bool:
    """Divide gradients by `scale` in place; True if any of this rank's is inf/NaN.

    A tensor-parallel gradient (a DTensor) is checked on this rank's shard, with no
    collective per parameter: the caller reduces the flag over all ranks once, so
    every rank skips the step alike (Megatron all-reduces found_inf the same way)."""
    nonfinite = []  # one flag per gradient, read back once (one device sync)
    inv = 1.0 / scale
    for p in params:
        if p.grad is None:
            continue
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        if scale != 1.0:
            grad.mul_(inv)
        nonfinite.append(~torch.isfinite(grad).all())
    return bool(torch.stack(nonfinite).any()) if nonfinite else False


def autocast_dtype(bf16: bool, fp16: bool) -> torch.dtype | None:
    """The dtype the forward runs in under autocast; None for plain fp32."""
    if bf16:
        return torch.bfloat16
    if fp16:
        return torch.float16
    return None
