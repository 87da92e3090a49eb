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

Each step gives the chosen module instances a subclass whose forward runs the
old one under a checkpoint (`mg.core.models.subclass`): parameter names stay
Megatron's, and whatever module a step before it left in place (Transformer
Engine's attention, a tensor-parallel dropout stream) is what gets recomputed.
The construction pipeline (`mg.core.parallel.construct`) runs recompute after
those steps and before compilation.

A recomputation is not a new forward: `recomputing()` is True while one runs,
so that state a forward accumulates (the MoE router's token counts for the
expert bias, its logged losses) is counted once, and `checkpointed_forward()`
while the original forward of a checkpointed region runs, so that a value it
computed from such state can be handed to its recomputation
(`mg.core.models.recompute_state`).
"""

from __future__ import annotations

from typing import Any, Literal

from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from mg.core.models.moe import MoELayer
from mg.core.models.recompute_state import (
    checkpointed_forward,
    recompute_context,
    recomputing,
)
from mg.core.models.subclass import extend_class

__all__ = [
    "Recomputed",
    "RecomputedMoELayer",
    "UniformlyRecomputedDecoder",
    "apply_activation_recompute",
    "apply_moe_layer_recompute",
    "checkpointed_forward",
    "recomputing",
]


def _checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
    return checkpoint(function, *args, use_reentrant=False, context_fn=recompute_context, **kwargs)


class Recomputed:
    """Mixin: the module's forward stores only its inputs and runs again in the backward
    pass (selective recompute of the attention core; full recompute, block method)."""

    _mg_recompute = True

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return _checkpoint(super().forward, *args, **kwargs)


class RecomputedMoELayer:
    """Mixin: an MoE layer (router, dispatch, experts) stores only its input, as
    Megatron's MoELayer under `recompute_modules=["moe"]`."""

    _mg_moe_recompute = True

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return _checkpoint(super().forward, *args, **kwargs)


def _run_layers(layers: list[nn.Module], hidden: Tensor, *args: Any) -> Tensor:
    for layer in layers:
        hidden = layer(hidden, *args)
    return hidden


class UniformlyRecomputedDecoder:
    """Mixin for a layer stack (TransformerBlock, a hybrid MambaStack, a pipeline stage's
    block): each run of `recompute_chunk` consecutive layers under one checkpoint, then
    the final norm (`final_layernorm`, or a hybrid stack's `final_norm`)."""

    _mg_recompute = True
    recompute_chunk: int = 1

    def forward(self, hidden: Tensor, *args: Any) -> Tensor:
        layers = list(self.layers)
        chunk = self.recompute_chunk
        for start in range(0, len(layers), chunk):
            hidden = _checkpoint(_run_layers, layers[start : start + chunk], hidden, *args)
        final_norm = getattr(self, "final_layernorm", None)
        if final_norm is None:
            final_norm = self.final_norm
        return final_norm(hidden)


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
    if any(getattr(m, "_mg_recompute", False) for m in model.modules()):
        raise ValueError("activation recompute is already applied to this model")
    if granularity == "selective":
        for layer in layers:
            extend_class(layer.self_attention.core_attention, Recomputed)
        return model
    if granularity != "full":
        raise ValueError(f"granularity must be 'selective' or 'full', got {granularity!r}")
    if num_layers < 1:
        raise ValueError(f"recompute num_layers must be >= 1, got {num_layers}")
    if method == "uniform":
        extend_class(decoder, UniformlyRecomputedDecoder)
        decoder.recompute_chunk = num_layers
    elif method == "block":
        for layer in layers[:num_layers]:
            extend_class(layer, Recomputed)
    else:
        raise ValueError(f"method must be 'uniform' or 'block', got {method!r}")
    return model


def apply_moe_layer_recompute(model: nn.Module) -> nn.Module:
    """Checkpoint every MoE layer's forward (Megatron's --moe-layer-recompute); in place.

    Its collectives (expert-parallel dispatch, the balancing losses' counts) run
    again in the backward pass, on every rank alike."""
    for module in model.modules():
        if isinstance(module, MoELayer) and not isinstance(module, RecomputedMoELayer):
            extend_class(module, RecomputedMoELayer)
    return model
