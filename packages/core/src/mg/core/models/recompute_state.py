"""Whether a checkpointed region is running for the first time or being recomputed.

State a forward accumulates (the MoE router's token counts for the expert
bias, its logged losses) must be counted once: `recomputing()` is True while a
checkpointed region runs again in the backward pass, `checkpointed_forward()`
while its first run does, so a value computed then can be handed to the
recomputation. The model code reads these; `mg.core.models.recompute` applies
the checkpoints with `recompute_context` as their `context_fn`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from mg.core.models.rng_stream import checkpoint_context

_depth = {"forward": 0, "recompute": 0}


def recomputing() -> bool:
    """True while a checkpointed region is recomputed in the backward pass."""
    return _depth["recompute"] > 0


def checkpointed_forward() -> bool:
    """True while the original forward of a checkpointed region runs (not its recompute)."""
    return _depth["forward"] > 0 and _depth["recompute"] == 0


@contextlib.contextmanager
def _within(kind: str, inner: contextlib.AbstractContextManager) -> Iterator[None]:
    _depth[kind] += 1
    try:
        with inner:
            yield
    finally:
        _depth[kind] -= 1


def recompute_context() -> tuple[contextlib.AbstractContextManager, ...]:
    """`context_fn` for torch.utils.checkpoint: the model-parallel RNG replayed
    (`checkpoint_context`) and `recomputing()` / `checkpointed_forward()` kept."""
    forward, recompute = checkpoint_context()
    return _within("forward", forward), _within("recompute", recompute)
