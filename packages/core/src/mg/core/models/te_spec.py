"""Megatron's Transformer Engine layer spec: the norms fused into the linears after them.

`get_gpt_layer_with_transformer_engine_spec` builds each GPT layer from TE's
modules: `self_attention.linear_qkv` and `mlp.linear_fc1` are `LayerNormLinear`s
(the layer's input norm and pre-MLP norm live inside them as
`layer_norm_weight`/`layer_norm_bias`), `linear_proj`/`linear_fc2` are TE
`Linear`s, `core_attention` is TE's `DotProductAttention`, and `input_layernorm`
/ `pre_mlp_layernorm` are identities with no weights. An MoE layer keeps its
pre-MLP norm as a module, as Megatron's spec does. A multi-latent attention layer
keeps its input norm too; its down projections are TE `Linear`s (whole on every rank),
its up projections `LayerNormLinear`s holding the latents' norms (`mg.core.models.mla`).

`TransformerConfig.transformer_impl = "transformer_engine"` builds our GPTModel
in that shape with plain PyTorch modules of the same names (`LayerNormLinear`
below; TE's `Linear` is named as `nn.Linear` is), so its state dict *is* a
Megatron TE-spec state dict (minus TE's `_extra_state` entries, which hold FP8
scaling state and no weights) and it runs anywhere. `apply_transformer_engine`
then swaps in TE's own modules on a GPU, one technique applied from outside as
tensor parallelism is; the state-dict names do not change, and TE adds its
`_extra_state` entries at Megatron's places. A tensor- or context-parallel
model gets TE's modules told its groups (`mg.core.models.te_parallel`). FP8 runs TE's modules under
`fp8_autocast` with Megatron's recipe choices (`fp8_recipe`, `fp8_autocast`).

Transformer Engine is the `gpu` extra, imported lazily: a missing package is
one line naming the extra.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mg.core.models.config import TransformerConfig
from mg.core.models.core_attention import build_te_core_attention, require_gpu_package
from mg.core.models.subclass import extend_class
from mg.core.models.te_parallel import TEParallelism, sharded_te_module

TE_FLAG = "--transformer-impl transformer_engine"
TE_FUSED_NORMS = (
    ("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
    ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"),
)
"""The local spec's norms (prefix within a layer) and their TE-spec names: each is the
`layer_norm_*` of the linear after it (Megatron's local-spec key map)."""
MLA_FUSED_NORMS = (
    ("self_attention.q_layernorm.", "self_attention.linear_q_up_proj.layer_norm_"),
    ("self_attention.kv_layernorm.", "self_attention.linear_kv_up_proj.layer_norm_"),
    ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"),
)
"""The same for a multi-latent-attention layer: Megatron's TE spec fuses the latents'
norms into the up projections and keeps `input_layernorm` a module (TENorm)."""
FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")
FP8_AMAX_COMPUTE_ALGOS = ("most_recent", "max")


def uses_te_spec(config: TransformerConfig) -> bool:
    """Whether `config` names its weights as Megatron's TE spec does."""
    return config.transformer_impl == "transformer_engine"


class LayerNormLinear(nn.Module):
    """norm(x) @ weightᵀ + bias, one module with TE `LayerNormLinear`'s parameter names.

    The same computation as `nn.LayerNorm`/`nn.RMSNorm` followed by `nn.Linear`
    (and numerically identical to them: the same functional ops), so a local-spec
    model and a TE-spec model with renamed weights give the same outputs.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        normalization: str,
        eps: float,
        zero_centered_gamma: bool = False,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.normalization, self.eps = normalization, eps
        self.zero_centered_gamma = zero_centered_gamma  # --apply-layernorm-1p: 1 + weight
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.layer_norm_weight = nn.Parameter(torch.empty(in_features))
        self.layer_norm_bias = (
            nn.Parameter(torch.empty(in_features)) if normalization == "LayerNorm" else None
        )

    def reset_layer_norm(self) -> None:
        """The norm's init (weight 1, bias 0, as nn.LayerNorm.reset_parameters does;
        weight 0 when zero-centred)."""
        if self.zero_centered_gamma:
            nn.init.zeros_(self.layer_norm_weight)
        else:
            nn.init.ones_(self.layer_norm_weight)
        if self.layer_norm_bias is not None:
            nn.init.zeros_(self.layer_norm_bias)

    def normalize(
        self, hidden: Tensor, weight: Tensor | None = None, bias: Tensor | None = None
    ) -> Tensor:
        """The norm alone. `weight`/`bias`: the norm's parameters as this computation
        sees them (tensor parallelism passes its local views; default: the module's)."""
        weight = self.layer_norm_weight if weight is None else weight
        bias = self.layer_norm_bias if bias is None else bias
        shape = (self.in_features,)
        gamma = weight + 1 if self.zero_centered_gamma else weight
        if self.normalization == "RMSNorm":
            return F.rms_norm(hidden, shape, gamma, self.eps)
        return F.layer_norm(hidden, shape, gamma, bias, self.eps)

    def forward(self, hidden: Tensor) -> Tensor:
        return F.linear(self.normalize(hidden), self.weight, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, normalization={self.normalization}"
        )


def input_linear(
    config: TransformerConfig, in_features: int, out_features: int, bias: bool, fused_norm: bool
) -> nn.Module:
    """The linear after a norm (linear_qkv, linear_fc1): with the norm inside it when
    `fused_norm` (the TE spec), a plain `nn.Linear` otherwise."""
    if not fused_norm:
        return nn.Linear(in_features, out_features, bias=bias)
    return LayerNormLinear(
        in_features,
        out_features,
        bias=bias,
        normalization=config.normalization,
        eps=config.layernorm_epsilon,
        zero_centered_gamma=config.layernorm_zero_centered_gamma,
    )


# --- names ---------------------------------------------------------------------------


def te_spec_names(state_dict: dict[str, Tensor], config: TransformerConfig) -> dict[str, Tensor]:
    """A local-spec state dict under the TE spec's names: each layer's norm becomes the
    `layer_norm_*` of the linear after it (Megatron's own local-spec key map,
    `mg.core.checkpoint.megatron_sharded_keys`); an MoE layer's pre-MLP norm stays. With
    multi-latent attention the latents' norms go into the up projections instead
    (`MLA_FUSED_NORMS`)."""
    moe = config.moe_layer_pattern
    fused = MLA_FUSED_NORMS if config.multi_latent_attention else TE_FUSED_NORMS
    out = {}
    for key, value in state_dict.items():
        parts = key.split(".", 3)
        if key.startswith("decoder.layers.") and len(parts) == 4:
            layer, rest = int(parts[2]), parts[3]
            for ours, theirs in fused:
                if rest.startswith(ours) and not (moe[layer] and ours == "pre_mlp_layernorm."):
                    key = f"decoder.layers.{layer}.{theirs}{rest[len(ours) :]}"
                    break
        out[key] = value
    return out


def te_spec_name(name: str) -> str:
    """One local-spec name under the TE spec's fused-norm name (others unchanged); a
    multi-latent attention's latent norms last (its input norm keeps its name)."""
    for ours, theirs in TE_FUSED_NORMS + MLA_FUSED_NORMS[:2]:
        if f".{ours}" in name and name.startswith("decoder.layers."):
            return name.replace(f".{ours}", f".{theirs}", 1)
    return name


def local_spec_names(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """Inverse of `te_spec_names`, dropping TE's `_extra_state` entries (FP8 scaling
    state, no weights)."""
    out = {}
    for key, value in state_dict.items():
        if key.endswith("_extra_state"):
            continue
        for ours, theirs in TE_FUSED_NORMS + MLA_FUSED_NORMS[:2]:
            if f".{theirs}" in key:
                key = key.replace(f".{theirs}", f".{ours}", 1)
                break
        out[key] = value
    return out


# --- Transformer Engine's own modules -------------------------------------------------


def transformer_engine_installed() -> bool:
    """Whether transformer_engine can be imported (without importing it)."""
    try:
        return importlib.util.find_spec("transformer_engine") is not None
    except ValueError:  # imported already, without a spec (a stand-in module)
        return "transformer_engine" in sys.modules


def import_transformer_engine(flag: str = TE_FLAG) -> Any:
    """`transformer_engine.pytorch`, or a one-line error naming the extra to install."""
    return require_gpu_package("transformer_engine.pytorch", "transformer-engine", flag)


def _copy_parameters(target: nn.Module, source: nn.Module, names: tuple[str, ...]) -> None:
    with torch.no_grad():
        for name in names:
            mine = getattr(source, name, None)
            if mine is None:
                continue
            getattr(target, name).copy_(mine)


def _te_layer_norm_linear(te: Any, old: LayerNormLinear, parallel: TEParallelism) -> nn.Module:
    kwargs = dict(
        in_features=old.in_features,
        out_features=old.out_features,
        eps=old.eps,
        bias=old.bias is not None,
        normalization=old.normalization,
        zero_centered_gamma=old.zero_centered_gamma,
        params_dtype=old.weight.dtype,
        device=old.weight.device,
    )
    if parallel.tp_size > 1:
        return sharded_te_module(te.LayerNormLinear, old, parallel, "column", **kwargs)
    new = te.LayerNormLinear(**kwargs)
    _copy_parameters(new, old, ("weight", "bias", "layer_norm_weight", "layer_norm_bias"))
    return new


def _te_linear(
    te: Any, old: nn.Linear, parallel: TEParallelism, parallel_mode: str | None = "row"
) -> nn.Module:
    """TE's Linear for `old`: row- or column-parallel, or (None) whole on every rank,
    Megatron's `parallel_mode="duplicated"` (MLA's down projections)."""
    kwargs = dict(
        in_features=old.in_features,
        out_features=old.out_features,
        bias=old.bias is not None,
        params_dtype=old.weight.dtype,
        device=old.weight.device,
    )
    if parallel.tp_size > 1 and parallel_mode is not None:
        return sharded_te_module(te.Linear, old, parallel, parallel_mode, **kwargs)
    new = te.Linear(**kwargs)
    _copy_parameters(new, old, ("weight", "bias"))
    return new


def apply_transformer_engine(
    model: nn.Module,
    fp8: FP8Options | None = None,
    config: TransformerConfig | None = None,
    parallel: TEParallelism | None = None,
) -> nn.Module:
    """Swap a TE-spec model's layers for Transformer Engine's modules in place, keeping
    the weights (and their names). Run it after the model holds its weights on the GPU
    and before data parallelism wraps it. With `fp8.param` (`--fp8-param-gather`) the
    linears are built under `fp8_model_init` and keep FP8 weights, as Megatron's
    `--fp8-param-gather` does. `config`: the model's (default `model.config`; a
    pipeline stage's parts share it). `parallel`: the tensor- and context-parallel
    groups the model was parallelised over (`mg.core.models.te_parallel`), which
    TE's modules are then told to communicate over."""
    config = config if config is not None else model.config
    parallel = parallel or TEParallelism()
    if not uses_te_spec(config):
        raise ValueError(
            "apply_transformer_engine needs a model built with "
            "transformer_impl='transformer_engine' (the TE spec's parameter names)"
        )
    if fp8 is not None and fp8.param and parallel.tp_size > 1:
        raise ValueError("FP8 weights (fp8.param) with tensor parallelism are not supported")
    te = import_transformer_engine()
    init = (
        te.fp8_model_init(enabled=True, recipe=fp8_recipe(fp8))
        if fp8 is not None and fp8.param
        else contextlib.nullcontext()
    )
    with init:
        for layer in model.modules():
            attention, mlp = getattr(layer, "self_attention", None), getattr(layer, "mlp", None)
            if attention is None or mlp is None:
                continue
            if hasattr(attention, "linear_kv_down_proj"):  # multi-latent attention
                _swap_mla_linears(te, attention, parallel)
            else:
                attention.linear_qkv = _te_layer_norm_linear(te, attention.linear_qkv, parallel)
            attention.linear_proj = _te_linear(te, attention.linear_proj, parallel)
            if not config.extra.get("export_force_local_attention"):  # else SDPA's, sinks
                old = attention.core_attention
                attention.core_attention = _kept_recompute(
                    old,
                    build_te_core_attention(
                        config,
                        layer.layer_number,
                        causal=getattr(old, "causal", True),
                        parallel=parallel,
                    ),
                )
            if isinstance(getattr(mlp, "linear_fc1", None), LayerNormLinear):  # not MoE's experts
                mlp.linear_fc1 = _te_layer_norm_linear(te, mlp.linear_fc1, parallel)
                mlp.linear_fc2 = _te_linear(te, mlp.linear_fc2, parallel)
            if fp8 is not None and layer.layer_number - 1 in fp8.bf16_layers:
                extend_class(layer, OutsideFP8)
    return model


def _kept_recompute(old: nn.Module, new: nn.Module) -> nn.Module:
    """`new` (TE's attention) under the selective recompute `old` was given, if any
    (`mg.core.models.recompute.Recomputed`, found by its `_mg_recompute` mark): swapped in
    after recompute, TE's attention is still recomputed in the backward pass, as Megatron's
    TE attention is through `checkpoint_core_attention`."""
    for mixin in type(old).__bases__:
        if "_mg_recompute" in vars(mixin) and not isinstance(new, mixin):
            extend_class(new, mixin)
    return new


def _swap_mla_linears(te: Any, attention: nn.Module, parallel: TEParallelism) -> None:
    """MLA's linears as Megatron's TE spec builds them: the down projections TE Linears
    whole on every rank (`duplicated`), the up projections (and linear_q_proj) column-
    parallel, as LayerNormLinears where they hold the latents' norms. The up projections
    take the whole sequence (tensor_parallel_mla gathers it on entry), so they are
    column-parallel without sequence parallelism."""
    heads = dataclasses.replace(parallel, sequence_parallel=False)
    for name in ("linear_q_down_proj", "linear_kv_down_proj"):
        if hasattr(attention, name):
            setattr(attention, name, _te_linear(te, getattr(attention, name), parallel, None))
    for name in ("linear_q_proj", "linear_q_up_proj", "linear_kv_up_proj"):
        old = getattr(attention, name, None)
        if isinstance(old, LayerNormLinear):
            setattr(attention, name, _te_layer_norm_linear(te, old, heads))
        elif old is not None:
            setattr(attention, name, _te_linear(te, old, heads, "column"))


class OutsideFP8:
    """Mixin: the layer runs with FP8 off inside an FP8 forward, as Megatron's
    get_fp8_context does for the layers `--first-last-layers-bf16` keeps in bf16."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with import_transformer_engine().fp8_autocast(enabled=False):
            return super().forward(*args, **kwargs)


# --- FP8 --------------------------------------------------------------------------------


@dataclass(frozen=True)
class FP8Options:
    """Megatron's FP8 settings (`--fp8-format`, `--fp8-recipe`, `--fp8-margin`, ...)."""

    format: str = "hybrid"
    recipe: str = "delayed"
    margin: int = 0
    amax_history_len: int = 1
    amax_compute_algo: str = "most_recent"
    wgrad: bool = True
    param: bool = False
    bf16_layers: tuple[int, ...] = ()
    """0-based layers that run outside FP8 (`--first-last-layers-bf16`)."""


def fp8_recipe(options: FP8Options) -> Any:
    """TE's recipe object for `options`, chosen as megatron.core.fp8_utils.get_fp8_recipe
    does: delayed → DelayedScaling (margin, amax history, wgrad in higher precision with
    --no-fp8-wgrad), tensorwise → Float8CurrentScaling, blockwise → Float8BlockScaling,
    mxfp8 → MXFP8BlockScaling; e4m3 or hybrid (e4m3 forward, e5m2 gradients)."""
    import_transformer_engine("--fp8-format")
    # lazy: Transformer Engine is the optional gpu extra
    from transformer_engine.common import recipe

    fmt = {"e4m3": recipe.Format.E4M3, "hybrid": recipe.Format.HYBRID}[options.format]
    if options.recipe == "delayed":
        return recipe.DelayedScaling(
            margin=options.margin,
            fp8_format=fmt,
            amax_history_len=options.amax_history_len,
            amax_compute_algo=options.amax_compute_algo,
            override_linear_precision=(False, False, not options.wgrad),
        )
    if options.recipe == "tensorwise":
        return recipe.Float8CurrentScaling(fp8_format=fmt)
    if options.recipe == "blockwise":
        return recipe.Float8BlockScaling(fp8_format=fmt)
    if options.recipe == "mxfp8":
        return recipe.MXFP8BlockScaling(fp8_format=fmt)
    raise ValueError(f"--fp8-recipe {options.recipe!r} is not one of {FP8_RECIPES}")


@contextlib.contextmanager
def fp8_autocast(options: FP8Options | None, group: Any = None) -> Iterator[None]:
    """TE's `fp8_autocast` for a forward pass (nothing without FP8). `group`: the ranks
    whose amaxes TE reduces together, Megatron's amax-reduction group (ranks of one
    pipeline stage); None: every rank, which under pipeline parallelism mixes stages
    that hold other layers."""
    if options is None:
        yield
        return
    te = import_transformer_engine("--fp8-format")
    with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe(options), fp8_group=group):
        yield


def init_linear(linear: nn.Module, std: float) -> None:
    """Megatron's init of a linear: normal(0, std) weights, zero bias, and the norm a TE
    spec fuses into its input linear (`input_linear`) reset."""
    nn.init.normal_(linear.weight, mean=0.0, std=std)
    if linear.bias is not None:
        nn.init.zeros_(linear.bias)
    if hasattr(linear, "reset_layer_norm"):
        linear.reset_layer_norm()
