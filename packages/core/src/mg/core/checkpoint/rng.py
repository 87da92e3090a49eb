"""Random-number-generator state, shaped as Megatron stores ``rng_state``.

Megatron saves ``state_dict["rng_state"]`` as a *list* with one dict per
data-parallel rank (a single entry unless ``--data-parallel-random-init``), each::

    {"random_rng_state": random.getstate(),
     "np_rng_state": np.random.get_state(),
     "torch_rng_state": torch.get_rng_state(),
     "cuda_rng_state": torch.cuda.get_rng_state(),
     "rng_tracker_states": {name: cuda generator state}}   # tensor-parallel tracker

On a machine without CUDA ``cuda_rng_state`` is ``None`` and, unless the caller
passes its own tracker, ``rng_tracker_states`` is ``{}``. Megatron-LM loading such
a checkpoint needs ``--no-load-rng`` (it calls ``torch.cuda.set_rng_state``
unconditionally and refuses an empty tracker).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch


def get_rng_state(tracker_states: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """This process's generators (python, numpy, torch CPU, CUDA when available)."""
    return {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "rng_tracker_states": dict(tracker_states or {}),
    }


def rng_state_list(tracker_states: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """``[get_rng_state()]``: the value Megatron stores under ``rng_state``."""
    return [get_rng_state(tracker_states)]


def set_rng_state(
    state: Mapping[str, Any] | Sequence[Mapping[str, Any]], data_parallel_rank: int = 0
) -> dict[str, Any]:
    """Restore generators from one entry or from Megatron's per-rank list.

    From a list, entry ``data_parallel_rank`` is used when the list has one per rank,
    else entry 0 (Megatron's rule). Returns ``rng_tracker_states`` for the caller's
    tensor-parallel tracker, which this function does not know about.
    """
    if not isinstance(state, Mapping):
        if not state:
            raise ValueError("rng_state is an empty list")
        state = state[data_parallel_rank] if data_parallel_rank < len(state) else state[0]
    random.setstate(_as_random_state(state["random_rng_state"]))
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    cuda_state = state.get("cuda_rng_state")
    if cuda_state is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda_state)
    return dict(state.get("rng_tracker_states") or {})


def _as_random_state(value: Any) -> tuple[Any, ...]:
    # random.setstate wants tuples; be lenient with lists (e.g. after a JSON round trip)
    version, internal, gauss = value
    return (version, tuple(internal), gauss)
