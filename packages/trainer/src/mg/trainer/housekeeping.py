"""What Megatron does around each iteration besides training: GC, cache, profiler.

- `--manual-gc`: Python's automatic collector is off during training and
  `gc.collect()` runs every `--manual-gc-interval` iterations, so every rank
  pauses at the same iteration instead of whenever its own allocator decides
  (a straggler in one rank stalls all of them). The collector is switched back
  on when training ends (Megatron leaves it off; mg-train also runs in-process).
- `--empty-unused-memory-level`: `torch.cuda.empty_cache()` after
  forward/backward (1) and also after the optimizer step (2); nothing on CPU.
- `--profile`: the torch profiler over iterations `--profile-step-start` to
  `--profile-step-end` on `--profile-ranks`, with Megatron's schedule (wait
  start-1, warm up 1, record end-start), its trace written to `--tensorboard-dir`
  as TensorBoard's profiler plugin reads it (`*.pt.trace.json`).
"""

from __future__ import annotations

import gc
from typing import Any

import torch

from mg.trainer.arguments import Args


class Housekeeping:
    """Per-run state of the three; the loop calls the hooks in iteration order."""

    def __init__(self, args: Args, rank: int) -> None:
        t = args.training
        self.manual_gc, self.gc_interval = t.manual_gc, t.manual_gc_interval
        self.empty_level = t.empty_unused_memory_level if torch.cuda.is_available() else 0
        self.profile_end = t.profile_step_end
        self.profiler: Any = None
        if t.profile and rank in t.profile_ranks:
            start = t.profile_step_start
            self.profiler = torch.profiler.profile(
                schedule=torch.profiler.schedule(
                    wait=max(start - 1, 0),
                    warmup=1 if start > 0 else 0,
                    active=t.profile_step_end - start,
                    repeat=1,
                ),
                on_trace_ready=torch.profiler.tensorboard_trace_handler(
                    args.logging.tensorboard_dir
                ),
                record_shapes=True,
                with_stack=True,
            )

    def start(self) -> None:
        if self.manual_gc:
            gc.disable()
            gc.collect()
        if self.profiler is not None:
            self.profiler.start()

    def before_iteration(self) -> None:
        if self.profiler is not None:
            self.profiler.step()

    def after_forward_backward(self) -> None:
        if self.empty_level >= 1:
            torch.cuda.empty_cache()

    def after_optimizer_step(self) -> None:
        if self.empty_level >= 2:
            torch.cuda.empty_cache()

    def after_iteration(self, iteration: int) -> None:
        """`iteration`: the number of the iteration just finished (Megatron's count)."""
        if self.profiler is not None and iteration == self.profile_end:
            self.profiler.stop()
            self.profiler = None
        if self.manual_gc and self.gc_interval != 0 and iteration % self.gc_interval == 0:
            gc.collect()

    def close(self) -> None:
        if self.profiler is not None:  # training ended before --profile-step-end
            self.profiler.stop()
            self.profiler = None
        if self.manual_gc:
            gc.enable()
