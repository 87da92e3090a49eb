"""Whether a checkpointed region is running for the first time or being recomputed.

State a forward accumulates (the MoE router's token counts for the expert
bias, its logged losses) must be counted once: `recomputing()` is True while a
checkpointed region runs again in the backward pass, `checkpointed_forward()`
while its first run does, so a value computed then can be handed to the
recomputation. The model code reads these; `mg.core.models.recompute` applies
the checkpoints with `recompute_context` as their `context_fn`.

`DiscardedOutput` is the other kind of checkpoint Megatron uses (for a norm, MLA's up
projections, the MoE experts' activation): the model code calls it where its
`recompute_*` switches say so.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

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


def inside_checkpoint() -> bool:
    """True inside a checkpointed region, first run or recomputation."""
    return _depth["forward"] > 0 or _depth["recompute"] > 0


def _autocast_state() -> dict[str, tuple[bool, torch.dtype]]:
    """Autocast as the forward runs it, per device type (the backward pass runs outside)."""
    devices = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
    return {d: (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in devices}


def _storage(tensor: Tensor) -> torch.UntypedStorage:
    """The memory behind `tensor` (a DTensor's: its local shard's)."""
    if isinstance(tensor, DTensor):
        tensor = tensor._local_tensor
    return tensor.untyped_storage()


class _DiscardedOutputRegion(torch.autograd.Function):
    """The region's forward without a graph (its inputs saved); its backward runs the
    graph the recomputation built (`DiscardedOutput._recompute`)."""

    @staticmethod
    def forward(ctx: Any, region: DiscardedOutput, *inputs: Tensor) -> Any:  # type: ignore[override]
        with torch.no_grad():
            outputs = region.function(*inputs)
        ctx.save_for_backward(*inputs)
        ctx.region = region
        region.ctx = ctx
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        region = ctx.region
        if region.recomputed is None:  # no hook fired (nothing was discarded)
            region._recompute()
        inputs, outputs = region.recomputed
        region.recomputed = region.ctx = None
        pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, *(x.grad if x.requires_grad else None for x in inputs))


class DiscardedOutput:
    """Megatron's output-discarding checkpoint (`CheckpointWithoutOutput`), plain PyTorch.

    `run(*inputs)` computes `function` without keeping its intermediate activations;
    the module after it saves the outputs as usual. Once that module has run,
    `discard(after)` frees the outputs' storage (the tensors stay, empty), and when the
    gradient reaches `after` in the backward pass the region runs again and refills
    that same storage, so the later module's saved tensors are whole when its own
    backward needs them. Memory: neither the region's activations nor its outputs
    live between the forward and the backward. Inside another checkpoint (whose
    recomputation builds graphs no hook reaches) and without gradients it is a plain
    call. The recomputation runs under the forward's autocast. `function` takes and
    returns tensors only, the outputs contiguous.
    """

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function
        self.active = torch.is_grad_enabled() and not inside_checkpoint()
        self.autocast = _autocast_state()
        self.outputs: tuple[Tensor, ...] = ()
        self.ctx: Any = None
        self.recomputed: tuple[tuple[Tensor, ...], tuple[Tensor, ...]] | None = None

    def run(self, *inputs: Tensor) -> Any:
        if not self.active:
            return self.function(*inputs)
        outputs = _DiscardedOutputRegion.apply(self, *inputs)
        self.outputs = (outputs,) if isinstance(outputs, Tensor) else tuple(outputs)
        return outputs

    def discard(self, after: Tensor) -> None:
        """Free the outputs; refill them when `after`'s gradient is computed."""
        if not self.active or not after.requires_grad:
            return
        for output in self.outputs:
            _storage(output).resize_(0)
        after.register_hook(self._refill)

    def _refill(self, grad: Tensor) -> None:
        if self.recomputed is None and self.ctx is not None:
            self._recompute()
            for kept, again in zip(self.outputs, self.recomputed[1], strict=True):
                storage = _storage(again)
                _storage(kept).resize_(storage.nbytes())
                _storage(kept).copy_(storage)
            self.outputs = ()

    def _recompute(self) -> None:
        inputs = tuple(x.detach().requires_grad_(x.requires_grad) for x in self.ctx.saved_tensors)
        with torch.enable_grad(), contextlib.ExitStack() as stack:
            for device, (enabled, dtype) in self.autocast.items():  # the forward's, again
                stack.enter_context(torch.autocast(device, dtype, enabled=enabled))
            outputs = self.function(*inputs)
        outputs = (outputs,) if isinstance(outputs, Tensor) else tuple(outputs)
        self.recomputed = (inputs, outputs)
