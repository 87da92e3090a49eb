"""Activation recompute, applied to a built `GPTModel` from outside.

Megatron-LM's flags map onto the arguments:
  --recompute-activations                  → granularity="selective"
  --recompute-granularity full
    --recompute-method uniform|block
    --recompute-num-layers N               → granularity="full", method=..., num_layers=N

selective: only the core attention (softmax(q kᵀ) v) is recomputed in the
    backward pass. It matters for the "unfused" attention whose [s, s] score
    matrix is the largest activation; SDPA's flash/memory-efficient kernels
    already avoid storing it, so there it saves little.
full, uniform: the layers are cut into consecutive chunks of N and each chunk
    stores only its input; everything inside is recomputed.
full, block: the first N layers each store only their input; the rest are
    not recomputed (trading memory for speed on a pipeline stage).

--moe-layer-recompute (`apply_moe_layer_recompute`): each MoE layer (router,
    dispatch, experts) stores only its input, as Megatron's MoELayer does
    under `recompute_modules=["moe"]`.

Instead of wrapping modules (which would add a path component to every
parameter name and break Megatron's checkpoint names), the `forward` of the
chosen module instances is replaced with a checkpointed call of the original.

A recomputation is not a new forward: `recomputing()` is True while one runs,
so that state a forward accumulates (the MoE router's token counts for the
expert bias, its logged losses) is counted once, and `checkpointed_forward()`
while the original forward of a checkpointed region runs, so that a value it
computed from such state can be handed to its recomputation.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, Literal

from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from mg.core.models.rng_stream import checkpoint_context

_MARK = "_mg_recompute"
_MOE_MARK = "_mg_moe_recompute"
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


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(
            forward, *args, use_reentrant=False, context_fn=recompute_context, **kwargs
        )

    return run


def _patch(module: nn.Module, forward: Callable[..., Any]) -> None:
    module.forward = forward
    setattr(module, _MARK, True)


def _uniform_decoder_forward(decoder: nn.Module, chunk: int) -> Callable[..., Tensor]:
    """The decoder loop with each run of `chunk` layers under one checkpoint."""

    def run_layers(layers: list[nn.Module], hidden: Tensor, *args: Any) -> Tensor:
        for layer in layers:
            hidden = layer(hidden, *args)
        return hidden

    def forward(hidden: Tensor, *args: Any) -> Tensor:
        layers = list(decoder.layers)
        for start in range(0, len(layers), chunk):
            hidden = checkpoint(
                run_layers,
                layers[start : start + chunk],
                hidden,
                *args,
                use_reentrant=False,
                context_fn=recompute_context,
            )
        return final_norm(hidden)

    # TransformerBlock's final_layernorm, a hybrid MambaStack's final_norm (or a stage's)
    final_norm = getattr(decoder, "final_layernorm", None)
    if final_norm is None:
        final_norm = decoder.final_norm
    return forward


def apply_activation_recompute(
    model: nn.Module,
    granularity: Literal["selective", "full"] = "selective",
    method: Literal["uniform", "block"] = "uniform",
    num_layers: int = 1,
) -> nn.Module:
    """Turn on activation recompute in `model` (a `GPTModel`) in place; returns it.

    Results and gradients are unchanged (up to dropout: the recomputation
    replays the RNG state, so they are unchanged with dropout too).
    """
    decoder = model.decoder
    layers = list(decoder.layers)
    if any(getattr(m, _MARK, False) for m in model.modules()):
        raise ValueError("activation recompute is already applied to this model")
    if granularity == "selective":
        for layer in layers:
            core = layer.self_attention.core_attention
            _patch(core, _checkpointed(core.forward))
        return model
    if granularity != "full":
        raise ValueError(f"granularity must be 'selective' or 'full', got {granularity!r}")
    if num_layers < 1:
        raise ValueError(f"recompute num_layers must be >= 1, got {num_layers}")
    if method == "uniform":
        _patch(decoder, _uniform_decoder_forward(decoder, num_layers))
    elif method == "block":
        for layer in layers[:num_layers]:
            _patch(layer, _checkpointed(layer.forward))
    else:
        raise ValueError(f"method must be 'uniform' or 'block', got {method!r}")
    return model


def apply_moe_layer_recompute(model: nn.Module) -> nn.Module:
    """Checkpoint every MoE layer's forward (Megatron's --moe-layer-recompute); in place.

    Its collectives (expert-parallel dispatch, the balancing losses' counts) run
    again in the backward pass, on every rank alike."""
    from mg.core.models.moe import MoELayer

    for module in model.modules():
        if isinstance(module, MoELayer) and not getattr(module, _MOE_MARK, False):
            module.forward = _checkpointed(module.forward)
            setattr(module, _MOE_MARK, True)
    return model
