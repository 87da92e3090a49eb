"""The recipes: which linears are quantized, how, and with what calibration.

Names as ModelOpt / llm-compressor use them:

    int8_wo    W8A16, int8 per output channel (round to nearest)
    int4_wo    W4A16, int4 per group of --group-size inputs (round to nearest)
    int4_awq   int4_wo after AWQ's activation-aware scale search (calibration)
    int4_gptq  int4 by GPTQ, with --gptq-damp and --act-order (calibration)
    int8_sq    W8A8: SmoothQuant-smoothed int8 weights, per-token int8 activations (calibration)
    fp8        E4M3 weights (per tensor, or per channel with --fp8-per-channel) and
               E4M3 activations with a static per-tensor scale from calibrated amax

The output layer (and an MoE router) stays in float unless the user quantizes it on
purpose; ``--exclude`` glob patterns keep more linears in float.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from mg.core.quantization import (
    INT4_RECIPES,
    Fp8Linear,
    Int4WeightOnlyLinear,
    Int8DynamicLinear,
    Int8WeightOnlyLinear,
    QuantizationConfig,
    QuantizedLinear,
    logits_through_output_module,
    set_submodule,
)
from mg.core.quantization.primitives import check_group_size, quantize_int4
from mg.quantize_export import awq, smoothquant
from mg.quantize_export.calibration import (
    AbsMax,
    Progress,
    RowSample,
    layer_prefixes,
    run_with_hooks,
)
from mg.quantize_export.errors import QuantizeInputError
from mg.quantize_export.gptq import HessianAccumulator, gptq_quantize

CALIBRATED = ("int4_awq", "int4_gptq", "int8_sq", "fp8")
DEFAULT_EXCLUDE = ("output_layer", "*router*")


@dataclass
class RecipeOptions:
    recipe: str
    group_size: int = 128
    symmetric: bool = True
    gptq_damp: float = 0.01
    act_order: bool = False
    sq_alpha: float = 0.5
    fp8_per_channel: bool = False
    awq_grid: int = 20
    awq_clip: bool = False
    exclude: list[str] = field(default_factory=list)
    quantize_output_layer: bool = False
    progress: bool = True


@dataclass
class QuantizeResult:
    config: QuantizationConfig
    weight_error: dict[str, float]
    """Relative Frobenius error ‖Ŵ − W‖ / ‖W‖ of each quantized linear."""


def target_linears(
    model: nn.Module, exclude: list[str], quantize_output_layer: bool = False
) -> list[str]:
    defaults = [p for p in DEFAULT_EXCLUDE if not (quantize_output_layer and p == "output_layer")]
    patterns = [*defaults, *exclude]
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and not any(fnmatch.fnmatch(name, p) for p in patterns)
    ]


def check_recipe(model: nn.Module, options: RecipeOptions, names: list[str]) -> None:
    if options.recipe in INT4_RECIPES:
        for name in names:
            linear = model.get_submodule(name)
            if linear.in_features % options.group_size:
                raise QuantizeInputError(
                    f"--group-size {options.group_size} does not divide {name}'s "
                    f"{linear.in_features} input features; use a group size that does "
                    "(32, 64, 128) or --exclude that layer"
                )
    if not names:
        raise QuantizeInputError("no linear layer is left to quantize (check --exclude)")


@torch.no_grad()
def quantize_model(
    model: nn.Module, options: RecipeOptions, samples: Tensor | None
) -> QuantizeResult:
    """Replace the model's target linears by quantized modules, in place."""
    names = target_linears(model, options.exclude, options.quantize_output_layer)
    check_recipe(model, options, names)
    if "output_layer" in names and hasattr(model, "output_and_loss"):
        logits_through_output_module(model)  # so calibration sees the output layer's inputs
    if options.recipe in CALIBRATED and samples is None:
        raise QuantizeInputError(
            f"--recipe {options.recipe} needs calibration data: give --calib-data-path"
        )
    errors: dict[str, float] = {}
    recipe = options.recipe
    if recipe in ("int8_wo", "int4_wo"):
        for name in names:
            _replace(model, name, options, errors)
    elif recipe == "int8_sq":
        stats = _observe(model, samples, {n: AbsMax() for n in names}, "calibrating", options)
        for name in names:
            norm = _norm_before(model, name)
            if norm is not None and stats[name].value is not None:
                linear = model.get_submodule(name)
                s = smoothquant.smoothing_factors(
                    stats[name].value, linear.weight, options.sq_alpha
                )
                smoothquant.fold_into_norm(norm, linear, s)
            _replace(model, name, options, errors)
    elif recipe == "fp8":
        stats = _observe(model, samples, {n: AbsMax() for n in names}, "calibrating", options)
        for name in names:
            _replace(model, name, options, errors, input_amax=_input_amax(stats, name))
    elif recipe == "int4_gptq":
        for group in _layer_groups(names):
            observers = {n: _Hessian(model.get_submodule(n).in_features) for n in group}
            stats = _observe(model, samples, observers, f"GPTQ {_label(group)}", options)
            for name in group:
                _replace(model, name, options, errors, hessian=stats[name].acc.hessian)
    elif recipe == "int4_awq":
        for group in _layer_groups(names):
            observers = {n: RowSample() for n in group}
            stats = _observe(model, samples, observers, f"AWQ {_label(group)}", options)
            scales = {n: _apply_awq(model, n, stats[n].value(), options) for n in group}
            if options.awq_clip:  # after every scale of the layer is folded, as AutoAWQ
                for name in group:
                    _clip_awq(model, name, stats[name].value(), scales[name], options)
            for name in group:
                _replace(model, name, options, errors)
    else:
        raise QuantizeInputError(f"unknown --recipe {recipe!r}")
    config = QuantizationConfig(
        recipe=recipe,
        modules=names,
        group_size=options.group_size if recipe in INT4_RECIPES else None,
        symmetric=options.symmetric,
        fp8_per_channel=options.fp8_per_channel,
        details=_details(options, samples),
    )
    return QuantizeResult(config, errors)


def _input_amax(stats: dict, name: str) -> float:
    """The calibrated input amax of `name`; for an expert no calibration token was routed
    to, the largest of its layer's other experts' same linear (the same kind of input)."""
    if stats[name].value is not None:
        return float(stats[name].value.max())
    prefix, _, leaf = name.rpartition(".")
    layer = prefix.rpartition(".local_experts.")[0]
    seen = [
        float(observer.value.max())
        for other, observer in stats.items()
        if observer.value is not None
        and other.endswith("." + leaf)
        and other.startswith(layer + ".local_experts.")
    ]
    if not layer or not seen:
        raise QuantizeInputError(
            f"--recipe fp8: {name} saw no calibration input; give more --calib-samples "
            f"or --exclude it"
        )
    return max(seen)


def _details(options: RecipeOptions, samples: Tensor | None) -> dict:
    details: dict = {}
    if samples is not None and options.recipe in CALIBRATED:
        details["calib_samples"], details["calib_seq_length"] = map(int, samples.shape)
    if options.recipe == "int4_gptq":
        details.update(gptq_damp=options.gptq_damp, act_order=options.act_order)
    if options.recipe == "int8_sq":
        details["smoothquant_alpha"] = options.sq_alpha
    if options.recipe == "int4_awq":
        details.update(awq_grid=options.awq_grid, awq_clip=options.awq_clip)
    if options.exclude:
        details["exclude"] = list(options.exclude)
    return details


class _Hessian:
    def __init__(self, columns: int) -> None:
        self.acc = HessianAccumulator(columns)

    def __call__(self, x: Tensor) -> None:
        self.acc.add(x)


def _observe(model, samples, observers, what: str, options: RecipeOptions) -> dict:
    progress = Progress(what, len(samples), options.progress)
    run_with_hooks(model, samples, observers, progress=progress)
    return observers


def _layer_groups(names: list[str]) -> list[list[str]]:
    """Linears grouped by transformer layer, in order: GPTQ and AWQ go layer by layer,
    each layer calibrated on the outputs of the layers already quantized."""
    groups: dict[str, list[str]] = {key: [] for key in layer_prefixes(names)}
    for name in names:
        parts = name.split(".")
        key = ".".join(parts[:3]) if parts[:2] == ["decoder", "layers"] else name
        groups[key].append(name)
    return list(groups.values())


def _label(group: list[str]) -> str:
    return ".".join(group[0].split(".")[:3])


def _norm_before(model: nn.Module, name: str) -> nn.Module | None:
    """The norm whose output is this linear's whole input (GPT layers: qkv and fc1)."""
    layer_name, _, rest = name.rpartition(".")
    layer_name = layer_name.rpartition(".")[0]
    if not layer_name:
        return None
    layer = model.get_submodule(layer_name)
    if name.endswith("self_attention.linear_qkv"):
        return getattr(layer, "input_layernorm", None)
    if name.endswith("mlp.linear_fc1"):
        return getattr(layer, "pre_mlp_layernorm", None)
    return None


def _apply_awq(
    model: nn.Module, name: str, inputs: Tensor | None, options: RecipeOptions
) -> Tensor | None:
    """Search the scales and fold them where the producer of the input can absorb 1/s;
    the scales, or None where there is no such producer."""
    if inputs is None:  # an expert no calibration token was routed to: plain int4
        return None
    linear = model.get_submodule(name)
    norm = _norm_before(model, name)
    producer = None
    if name.endswith("mlp.linear_fc2"):
        mlp = model.get_submodule(name.rpartition(".")[0])
        fc1 = getattr(mlp, "linear_fc1", None)
        if getattr(mlp, "gated", False) and isinstance(fc1, nn.Linear):
            producer = fc1  # act(gate) * up: scaling the up rows scales fc2's input
    rows = None
    if name.endswith("self_attention.linear_proj"):
        qkv = getattr(model.get_submodule(name.rpartition(".")[0]), "linear_qkv", None)
        rows = _value_rows(getattr(model, "config", None))
        if isinstance(qkv, nn.Linear) and rows is not None:
            producer = qkv  # attention is linear in v: scaling v's rows scales proj's input
    if norm is None and producer is None:
        return None  # no place to fold 1/s (GQA attention output, ungated MLP): plain int4
    scales, _alpha = awq.search_awq_scales(
        linear.weight, inputs, options.group_size, options.symmetric, options.awq_grid,
        duo_scaling="both",
    )  # fmt: skip
    if norm is not None:
        smoothquant.fold_into_norm(norm, linear, scales)
        return scales
    if rows is None:  # a gated fc1: its up half
        half = producer.out_features // 2
        rows = torch.arange(half, producer.out_features)
    producer.weight[rows] /= scales[:, None].to(producer.weight.dtype)
    if producer.bias is not None:
        producer.bias[rows] /= scales.to(producer.bias.dtype)
    linear.weight.mul_(scales[None, :].to(linear.weight.dtype))
    return scales


def _value_rows(config) -> Tensor | None:
    """Rows of the fused linear_qkv that hold the value heads, in linear_proj's input
    order, where each query head has its own value head (AutoAWQ folds o_proj's scales
    into v_proj only then: with grouped queries one value head feeds several)."""
    if config is None or config.num_query_groups != config.num_attention_heads:
        return None
    d, heads = config.kv_channels, config.num_attention_heads
    return torch.cat([torch.arange(h * 3 * d + 2 * d, h * 3 * d + 3 * d) for h in range(heads)])


def _clip_awq(
    model: nn.Module,
    name: str,
    inputs: Tensor | None,
    scales: Tensor | None,
    options: RecipeOptions,
) -> None:
    """AWQ's clipping search on the (scaled) weight, with the inputs it now sees (x / s)."""
    if name.endswith("linear_qkv") or inputs is None:
        return  # AutoAWQ leaves q and k unclipped: clipping them moves the attention scores
    linear = model.get_submodule(name)
    if scales is not None:
        inputs = inputs / scales.to(inputs.dtype)
    max_val = awq.search_awq_clip(linear.weight, inputs, options.group_size, options.symmetric)
    awq.apply_awq_clip(linear.weight.data, max_val)


def _replace(
    model: nn.Module,
    name: str,
    options: RecipeOptions,
    errors: dict[str, float],
    *,
    input_amax: float = 0.0,
    hessian: Tensor | None = None,
) -> None:
    linear: nn.Linear = model.get_submodule(name)
    weight = linear.weight.detach().float()
    recipe = options.recipe
    quantized: QuantizedLinear
    if recipe == "int8_wo":
        quantized = Int8WeightOnlyLinear.from_linear(linear, weight)
    elif recipe == "int8_sq":
        quantized = Int8DynamicLinear.from_linear(linear, weight)
    elif recipe == "fp8":
        quantized = Fp8Linear.from_linear(linear, input_amax, options.fp8_per_channel, weight)
    elif recipe == "int4_gptq":
        assert hessian is not None
        q, scale, zero = gptq_quantize(
            weight,
            hessian,
            options.group_size,
            options.symmetric,
            options.gptq_damp,
            options.act_order,
        )
        quantized = Int4WeightOnlyLinear.from_quantized(linear, q, scale, zero)
    else:
        check_group_size(linear.in_features, options.group_size, name)
        quantized = Int4WeightOnlyLinear.from_quantized(
            linear, *quantize_int4(weight, options.group_size, options.symmetric)
        )
    quantized.to(linear.weight.device)
    if quantized.bias is not None:
        quantized.bias.data = quantized.bias.data.to(linear.weight.dtype)
    errors[name] = float((quantized.dequantized_weight() - weight).norm() / weight.norm())
    set_submodule(model, name, quantized)
