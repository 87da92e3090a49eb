"""`--log-timers-to-tensorboard`: the step's timers, as Megatron's `Timers.write`.

Two timers, bounded by the trainer's housekeeping hooks (so the training step needs
no timer calls of its own): `forward-backward`, from the start of the iteration to
the end of the last micro-batch's backward, and `optimizer`, from there to the end
of the optimizer step. mg's `optimizer` so holds the gradient reduction (Megatron
times its `all-grads-sync` inside `forward-backward`), unscaling, clipping and the
update. Each is written as `<name>-time`: seconds per iteration since the last write,
the slowest rank's (Megatron's `max_time / normalizer`).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from mg.core.parallel.collective_device import collective_device
from mg.trainer.housekeeping import Housekeeping

NAMES = ("forward-backward", "optimizer")


class StepTimers:
    """Wall-clock seconds per timer since the last `scalars()`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.elapsed = dict.fromkeys(NAMES, 0.0)
        self.iterations = 0
        self._started: dict[str, float] = {}

    def _now(self) -> float:
        if self.device.type == "cuda":  # the kernels queued so far belong to the interval
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def start(self, name: str) -> None:
        self._started[name] = self._now()

    def stop(self, name: str) -> None:
        started = self._started.pop(name, None)
        if started is not None:
            self.elapsed[name] += self._now() - started

    def scalars(self) -> dict[str, float]:
        """`<name>-time` per iteration, the maximum over ranks (a collective); resets."""
        per_iteration = torch.tensor(
            [self.elapsed[n] / max(self.iterations, 1) for n in NAMES], dtype=torch.float64
        )
        if dist.is_initialized() and dist.get_world_size() > 1:
            reduced = per_iteration.to(collective_device())
            dist.all_reduce(reduced, op=dist.ReduceOp.MAX)
            per_iteration = reduced.cpu()
        self.elapsed = dict.fromkeys(NAMES, 0.0)
        self.iterations = 0
        return {f"{n}-time": float(v) for n, v in zip(NAMES, per_iteration, strict=True)}


class TimedHousekeeping:
    """The trainer's housekeeping hooks, with the timers started and stopped around them
    (the hooks' own work, a cache flush or a GC pass, outside the intervals)."""

    def __init__(self, inner: Housekeeping, timers: StepTimers) -> None:
        self.inner = inner
        self.timers = timers

    def start(self) -> None:
        self.inner.start()

    def before_iteration(self) -> None:
        self.inner.before_iteration()
        self.timers.start("forward-backward")

    def after_forward_backward(self) -> None:
        self.timers.stop("forward-backward")
        self.inner.after_forward_backward()
        self.timers.start("optimizer")

    def after_optimizer_step(self) -> None:
        self.timers.stop("optimizer")
        self.timers.iterations += 1
        self.inner.after_optimizer_step()

    def after_iteration(self, iteration: int) -> None:
        self.inner.after_iteration(iteration)

    def close(self) -> None:
        self.inner.close()
