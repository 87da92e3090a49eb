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
Retro: its neighbour encoder (inside the first Retro layer) is a layer stack of its
    own, recomputed as the decoder is (Megatron builds it as a TransformerBlock with
    the same config); selective recompute covers the cross-attention cores too.

--moe-layer-recompute (`apply_moe_layer_recompute`): each MoE layer (router,
    dispatch, experts) stores only its input, as Megatron's MoELayer does
    under `recompute_modules=["moe"]`.

--recompute-granularity selective --recompute-modules ... (`apply_recompute_modules`),
    Megatron's choices and meanings:
    core_attn       the attention core (as selective above);
    moe             each MoE layer (as --moe-layer-recompute);
    mlp             each dense MLP (with the TE spec's pre-MLP norm inside its fc1);
    shared_experts  each MoE layer's shared experts;
    layernorm       the input and pre-MLP norms that are modules (the TE spec fuses most
                    into the linear after them: nothing to recompute there);
    mla_up_proj     multi-latent attention's up projections and RoPE;
    moe_act         the routed experts' activation (grouped GEMM experts only).
    The first four checkpoint a module (it stores its inputs only); the last three
    discard an output once the module after it has saved it and recompute it when the
    backward pass gets there (`recompute_state.DiscardedOutput`, Megatron's
    `CheckpointWithoutOutput`): switches the model code reads, on the layer, the
    attention and the experts, which Transformer Engine's swap leaves in place.

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

from collections.abc import Sequence
from typing import Any, Literal

from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from mg.core.models.mla import MLASelfAttention
from mg.core.models.moe import MoELayer
from mg.core.models.moe.experts import GroupedMLP
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
    "UniformlyRecomputedStack",
    "RECOMPUTE_MODULES",
    "RecomputedModule",
    "apply_activation_recompute",
    "apply_moe_layer_recompute",
    "apply_recompute_modules",
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


class UniformlyRecomputedStack:
    """Mixin for a layer stack that runs its layers through `run_layers(layers, carried,
    *fixed) -> carried` (Retro's decoder, whose runs carry the neighbours along, and its
    neighbour encoder): each run of `recompute_chunk` consecutive layers under one
    checkpoint, as Megatron's TransformerBlock does for every block it builds."""

    _mg_recompute = True
    recompute_chunk: int = 1

    def run_layers(self, layers: list[nn.Module], carried: tuple, *fixed: Any) -> tuple:
        chunk = self.recompute_chunk
        run = super().run_layers
        for start in range(0, len(layers), chunk):
            carried = _checkpoint(run, layers[start : start + chunk], carried, *fixed)
        return carried


def _layer_stacks(model: nn.Module) -> list[nn.Module]:
    """The model's decoder and the layer stacks nested in its layers that run them
    through `run_layers` (Retro's neighbour encoder inside its first Retro layer)."""
    decoder = model.decoder
    nested = [m for m in decoder.modules() if m is not decoder and hasattr(type(m), "run_layers")]
    return [decoder, *nested]


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
    stacks = _layer_stacks(model)
    layers = [layer for stack in stacks for layer in stack.layers]
    if any(getattr(m, "_mg_recompute", False) for m in model.modules()):
        raise ValueError("activation recompute is already applied to this model")
    if granularity == "selective":
        for layer in layers:
            extend_class(layer.self_attention.core_attention, Recomputed)
            # a Retro layer's cross-attention core too (Megatron's Attention, any kind)
            cross = getattr(getattr(layer, "cross_attention", None), "attn", None)
            if cross is not None:
                extend_class(cross.core_attention, Recomputed)
        return model
    if granularity != "full":
        raise ValueError(f"granularity must be 'selective' or 'full', got {granularity!r}")
    if num_layers < 1:
        raise ValueError(f"recompute num_layers must be >= 1, got {num_layers}")
    if method == "uniform" and hasattr(type(decoder), "run_layers"):
        for stack in stacks:  # Retro: the decoder's and the encoder's runs of layers
            extend_class(stack, UniformlyRecomputedStack)
            stack.recompute_chunk = num_layers
    elif method == "uniform":
        extend_class(decoder, UniformlyRecomputedDecoder)
        decoder.recompute_chunk = num_layers
    elif method == "block":
        for stack in stacks:  # each stack's first layers, as Megatron's blocks
            for layer in list(stack.layers)[:num_layers]:
                extend_class(layer, Recomputed)
    else:
        raise ValueError(f"method must be 'uniform' or 'block', got {method!r}")
    return model


class RecomputedModule:
    """Mixin: a submodule (dense MLP, shared experts) stores only its inputs, Megatron's
    `mlp` / `shared_experts` recompute."""

    _mg_module_recompute = True

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return _checkpoint(super().forward, *args, **kwargs)


RECOMPUTE_MODULES = (
    "core_attn",
    "moe_act",
    "layernorm",
    "mla_up_proj",
    "mlp",
    "moe",
    "shared_experts",
)
"""megatron-core's `recompute_modules` choices."""


def apply_recompute_modules(model: nn.Module, modules: Sequence[str]) -> nn.Module:
    """Megatron's selective recompute of `modules` (its names, `RECOMPUTE_MODULES`) in
    `model` (a GPTModel or a pipeline stage of one), in place; returns it. Results and
    gradients are unchanged."""
    unknown = [m for m in modules if m not in RECOMPUTE_MODULES]
    if unknown:
        raise ValueError(f"recompute_modules {unknown}: not among {RECOMPUTE_MODULES}")
    layers = [m for m in model.modules() if hasattr(m, "recompute_input_layernorm")]
    mlps = [layer.mlp for layer in layers if not isinstance(layer.mlp, MoELayer)]
    moes = [m for m in model.modules() if isinstance(m, MoELayer)]
    if "core_attn" in modules:
        apply_activation_recompute(model, "selective")
    if "moe" in modules:
        apply_moe_layer_recompute(model)
    if "mlp" in modules:
        for mlp in mlps:
            extend_class(mlp, RecomputedModule)
    if "shared_experts" in modules:
        for moe in moes:
            if moe.shared_experts is not None:
                extend_class(moe.shared_experts, RecomputedModule)
    if "layernorm" in modules:
        for layer in layers:
            layer.recompute_input_layernorm = layer.recompute_pre_mlp_layernorm = True
    if "mla_up_proj" in modules:
        attentions = [layer.self_attention for layer in layers]
        if not all(isinstance(a, MLASelfAttention) for a in attentions):
            raise ValueError(
                "recompute_modules mla_up_proj needs multi-latent attention (Megatron's rule)"
            )
        for attention in attentions:
            attention.recompute_up_proj = True
    if "moe_act" in modules:
        if not all(isinstance(moe.experts, GroupedMLP) for moe in moes):
            raise ValueError(
                "recompute_modules moe_act needs the grouped-GEMM experts (moe_grouped_gemm), "
                "as in Megatron"
            )
        for moe in moes:
            moe.experts.recompute_activation = True
    return model


def apply_moe_layer_recompute(model: nn.Module) -> nn.Module:
    """Checkpoint every MoE layer's forward (Megatron's --moe-layer-recompute); in place.

    Its collectives (expert-parallel dispatch, the balancing losses' counts) run
    again in the backward pass, on every rank alike."""
    for module in model.modules():
        if isinstance(module, MoELayer) and not isinstance(module, RecomputedMoELayer):
            extend_class(module, RecomputedMoELayer)
    return model
