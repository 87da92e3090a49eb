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

Instead of wrapping modules (which would add a path component to every
parameter name and break Megatron's checkpoint names), the `forward` of the
chosen module instances is replaced with a checkpointed call of the original.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal

from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from mg.core.models.rng_stream import checkpoint_context

_MARK = "_mg_recompute"


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(
            forward, *args, use_reentrant=False, context_fn=checkpoint_context, **kwargs
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
                context_fn=checkpoint_context,
            )
        return decoder.final_layernorm(hidden)

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
