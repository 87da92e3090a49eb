"""The model side of generation: one forward over a batch of rows, each in its own cache slot.

The engine decides *what* to run (which tokens, at which positions, in which
slots); the runner runs it. `tensor_parallel.TensorParallelRunner` is the
runner for a TP-sharded model: it broadcasts each step from rank 0 so that
every rank runs the same forward on its shard of the heads.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mg.core.models import GPTModel
from mg.core.models.kv_cache import KVCache


class ModelRunner:
    """A GPTModel and the KVCache it decodes with (`num_slots` sequences of `max_length`)."""

    def __init__(self, model: GPTModel, num_slots: int, max_length: int) -> None:
        self.model = model.eval()
        self.cache = KVCache.for_model(model, num_slots=num_slots, max_length=max_length)
        self.num_slots = num_slots
        self.max_length = max_length
        self.device = next(model.parameters()).device
        self.heartbeat_seconds: float | None = None
        """When set, the engine calls `heartbeat` after this long idle."""

    @torch.inference_mode()
    def forward(self, input_ids: Tensor, slots: Tensor, starts: Tensor) -> Tensor:
        """input_ids [b, s] whose row r starts at position starts[r] of slot slots[r]
        → fp32 logits [b, s, vocab]."""
        b, s = input_ids.shape
        positions = starts[:, None] + torch.arange(s)[None, :]
        self.cache.bind(slots, starts)
        logits = self.model(
            input_ids.to(self.device), positions.to(self.device), inference_cache=self.cache
        )
        return logits.float().cpu()

    def heartbeat(self) -> None:
        """Called while idle (every `heartbeat_seconds`): nothing to do in one process."""

    def close(self) -> None:
        """Called once by the engine thread when it stops."""
