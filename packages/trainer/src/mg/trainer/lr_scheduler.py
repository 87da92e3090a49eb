"""Megatron's OptimizerParamScheduler: warmup, then one of five decay styles, in samples.

Steps are counted in samples, not iterations, so the schedule does not change
shape when the global batch size ramps up. The learning rate at step n is
(Megatron's `get_lr`, reproduced on purpose including its quirks):

- warmup (n <= warmup): init + (max - init) * n / warmup;
- constant: max;
- n > decay: min;
- inverse-square-root: max(min, max * sqrt(max(warmup, 1)) / sqrt(max(n, 1)));
- otherwise r = (n - warmup) / (decay - warmup) and lr = min + coeff * (max - min),
  coeff = 1 - r (linear), (cos(pi r) + 1) / 2 (cosine), or for WSD 1 until the
  last `wsd_decay` samples and then the chosen annealing shape.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mg.trainer.arguments import Args


class OptimizerParamScheduler:
    """Sets `lr` of every parameter group of `optimizer` after each `step(increment)`."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer | None,
        *,
        init_lr: float,
        max_lr: float,
        min_lr: float,
        lr_warmup_steps: float,
        lr_decay_steps: float,
        lr_decay_style: str,
        wsd_decay_steps: float | None = None,
        lr_wsd_decay_style: str = "exponential",
    ) -> None:
        if lr_decay_steps <= 0 or lr_warmup_steps >= lr_decay_steps:
            raise ValueError(
                f"learning rate decay ({lr_decay_steps} samples) must be positive and longer "
                f"than the warmup ({lr_warmup_steps} samples)"
            )
        if lr_decay_style == "WSD" and not wsd_decay_steps:
            raise ValueError("WSD needs a positive decay length (--lr-wsd-decay-iters|samples)")
        self.optimizer = optimizer
        self.init_lr = init_lr
        self.max_lr = max_lr
        self.min_lr = min_lr
        self.lr_warmup_steps = lr_warmup_steps
        self.lr_decay_steps = lr_decay_steps
        self.lr_decay_style = lr_decay_style
        self.wsd_decay_steps = wsd_decay_steps
        self.lr_wsd_decay_style = lr_wsd_decay_style
        self.num_steps = 0
        self.step(0)

    def get_lr(self, group: dict[str, Any] | None = None) -> float:
        """The learning rate at `self.num_steps` samples."""
        n = self.num_steps
        # a parameter group's own peak and floor (--decoupled-lr), as Megatron's get_lr
        group = group or {}
        max_lr, min_lr = group.get("max_lr", self.max_lr), group.get("min_lr", self.min_lr)
        if self.lr_warmup_steps > 0 and n <= self.lr_warmup_steps:
            return self.init_lr + (max_lr - self.init_lr) * float(n) / float(self.lr_warmup_steps)
        if self.lr_decay_style == "constant":
            return max_lr
        if n > self.lr_decay_steps:
            return min_lr
        if self.lr_decay_style == "inverse-square-root":
            warmup = max(self.lr_warmup_steps, 1)
            return max(min_lr, max_lr * warmup**0.5 / max(n, 1) ** 0.5)
        ratio = float(n - self.lr_warmup_steps) / float(self.lr_decay_steps - self.lr_warmup_steps)
        if self.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        elif self.lr_decay_style == "WSD":
            anneal_start = self.lr_decay_steps - self.wsd_decay_steps
            if n <= anneal_start:
                coeff = 1.0
            else:
                wsd_ratio = float(n - anneal_start) / float(self.wsd_decay_steps)
                style = self.lr_wsd_decay_style
                if style == "linear":
                    coeff = 1.0 - wsd_ratio
                elif style == "cosine":
                    coeff = 0.5 * (math.cos(math.pi * wsd_ratio) + 1.0)
                elif style == "exponential":
                    coeff = 2.0 * math.pow(0.5, wsd_ratio) - 1.0
                elif style == "minus_sqrt":
                    coeff = 1.0 - math.sqrt(wsd_ratio)
                else:
                    raise ValueError(f"unknown WSD decay style {style!r}")
        else:
            raise ValueError(f"unknown learning rate decay style {self.lr_decay_style!r}")
        return min_lr + coeff * (max_lr - min_lr)

    def step(self, increment: int) -> float:
        """Advance by `increment` samples (one global batch) and set the new rate."""
        self.num_steps += increment
        lr = self.get_lr()
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = self.get_lr(group)
        return lr

    def state_dict(self) -> dict[str, Any]:
        return {
            "max_lr": self.max_lr,
            "lr_warmup_steps": self.lr_warmup_steps,
            "num_steps": self.num_steps,
            "lr_decay_style": self.lr_decay_style,
            "lr_decay_steps": self.lr_decay_steps,
            "min_lr": self.min_lr,
            "wsd_decay_steps": self.wsd_decay_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the step count; the schedule's shape comes from the current flags (Megatron's
        `--override-opt_param-scheduler` behaviour, which is simpler to reason about)."""
        self.num_steps = 0
        self.step(int(state["num_steps"]))


def build_scheduler(
    args: Args, optimizer: torch.optim.Optimizer | None, train_iters: int
) -> OptimizerParamScheduler:
    """The schedule in samples from iteration- or sample-based flags (Megatron's rules)."""
    o, t = args.optimizer, args.training
    gbs = t.global_batch_size
    if t.train_iters is not None:
        decay = (o.lr_decay_iters if o.lr_decay_iters is not None else train_iters) * gbs
        warmup_explicit = o.lr_warmup_iters * gbs
        wsd = o.lr_wsd_decay_iters * gbs if o.lr_wsd_decay_iters is not None else None
    else:
        decay = o.lr_decay_samples if o.lr_decay_samples is not None else t.train_samples
        warmup_explicit = o.lr_warmup_samples
        wsd = o.lr_wsd_decay_samples
    # --lr-warmup-fraction wins over warmup iters/samples, as in Megatron.
    warmup = o.lr_warmup_fraction * decay if o.lr_warmup_fraction is not None else warmup_explicit
    return OptimizerParamScheduler(
        optimizer,
        init_lr=o.lr_warmup_init,
        max_lr=o.lr,
        min_lr=o.min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=decay,
        lr_decay_style=o.lr_decay_style,
        wsd_decay_steps=wsd,
        lr_wsd_decay_style=o.lr_wsd_decay_style,
    )
