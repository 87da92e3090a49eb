"""The device a process group's collectives take their tensors on.

NCCL reduces CUDA tensors only (on the rank's current device); gloo takes CPU
tensors. Every collective on a host-side value (a norm, a count, a timer) moves it
here first, so the same code runs on both backends.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where `group`'s backend (the default group's without one) wants its tensors."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
