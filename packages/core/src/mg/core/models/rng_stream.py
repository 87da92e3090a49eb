"""A second random stream for dropout whose masks must differ between ranks.

Megatron keeps a "model-parallel" RNG state next to the default one (seeded
`seed + 2718 + tp_rank`) and draws the dropout masks of tensor-parallel regions
from it: attention dropout over this rank's heads and, with sequence
parallelism, the hidden dropout over this rank's slice of the sequence.
Drawing them from the default stream, which is seeded alike on every rank so
that replicated work stays identical, would give every rank the same mask.

`RNGStream.fork()` swaps the stream in for the default generator of its device
and back. Activation recompute must replay it as it replays the default
stream: `checkpoint_context` (torch.utils.checkpoint's `context_fn`) restores
the stream's state from the original forward during the recomputation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor


def _get_state(device: torch.device) -> Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_state(device: torch.device, state: Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class RNGStream:
    """A generator state of `device`, used in place of the default one inside `fork()`."""

    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self.state = torch.Generator(device=device).manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        outside = _get_state(self.device)
        _set_state(self.device, self.state)
        try:
            yield
        finally:
            self.state = _get_state(self.device)
            _set_state(self.device, outside)


_model_parallel: RNGStream | None = None


def set_model_parallel_stream(stream: RNGStream | None) -> None:
    """The stream tensor-parallel dropout forks to (one model per process trains)."""
    global _model_parallel
    _model_parallel = stream


def model_parallel_stream() -> RNGStream | None:
    return _model_parallel


def checkpoint_context() -> tuple[contextlib.AbstractContextManager, ...]:
    """`context_fn` for torch.utils.checkpoint: the recomputation sees the model-parallel
    stream as the original forward did, and the stream goes on from where it was."""
    stream = _model_parallel
    if stream is None:
        return contextlib.nullcontext(), contextlib.nullcontext()
    at_forward = stream.state.clone()

    @contextlib.contextmanager
    def replay() -> Iterator[None]:
        now, stream.state = stream.state, at_forward.clone()
        try:
            yield
        finally:
            stream.state = now

    return contextlib.nullcontext(), replay()


TRACKER_NAME = "model-parallel-rng"
"""The key Megatron's checkpoints use for this stream in `rng_tracker_states`."""


def tracker_states() -> dict[str, Tensor]:
    """The stream's state for a checkpoint's `rng_tracker_states` (empty without one)."""
    stream = _model_parallel
    return {TRACKER_NAME: stream.state.clone()} if stream is not None else {}


def restore_tracker_states(states: dict[str, Tensor]) -> None:
    """Put a checkpoint's stream state back (a no-op without a stream or a saved state)."""
    stream = _model_parallel
    if stream is not None and TRACKER_NAME in states:
        stream.state = states[TRACKER_NAME].clone()
