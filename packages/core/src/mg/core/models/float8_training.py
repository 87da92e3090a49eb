"""FP8 training on PyTorch's own kernels: torchao's float8 linears, where TE is absent.

torchao (PyPI `torchao`, the path torchtitan trains FP8 with) swaps a model's
`nn.Linear`s for `Float8Linear`s, whose matmuls cast their operands to FP8 with
dynamic scales and run `torch._scaled_mm` (Ada, Hopper and newer GPUs). It is a
library the field uses, a few MB with no CUDA build, so FP8 runs wherever torch
does; Transformer Engine stays the backend when `--transformer-impl
transformer_engine` asks for its layers.

Megatron's flags map onto torchao's configuration:

| Megatron | torchao |
| --- | --- |
| `--fp8-recipe tensorwise` | one dynamic scale per tensor (torchao's `tensorwise`) |
| `--fp8-recipe rowwise` (ours; Megatron has none) | one scale per row (`rowwise`, e4m3 only) |
| `--fp8-format hybrid` / `e4m3` | gradients in e5m2 / e4m3 (forward operands e4m3) |
| `--no-fp8-wgrad` | the weight-gradient matmul in high precision |
| `--first-last-layers-bf16` | those layers' linears left as they are |
| `--fp8-param-gather` (with FSDP) | FP8 weight all-gather (`enable_fsdp_float8_all_gather`) |

`delayed`, `mxfp8` and `blockwise` have no torchao training recipe on Hopper and
are refused by name (`refusal`), as are the delayed-scaling knobs. Only the
linears of the decoder's transformer layers are converted (as TE's FP8 covers
its layers): embeddings, the output layer, routers and grouped experts keep
their precision, and a linear whose dimensions are not multiples of 16 (what
`_scaled_mm` needs) is left as is. Conversion runs before tensor parallelism:
the TP styles then see `Float8Linear`s, which are `nn.Linear`s.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from mg.core.models.te_spec import FP8Options

TORCHAO_RECIPES = ("tensorwise", "rowwise")
_DELAYED_DEFAULTS = {"margin": 0, "amax_history_len": 1, "amax_compute_algo": "most_recent"}
_LAYER = re.compile(r"(?:^|\.)decoder\.layers\.(\d+)\.")
_MATMUL_MULTIPLE = 16


class Float8Unavailable(RuntimeError):
    """torchao is not installed."""


def refusal(options: FP8Options) -> str | None:
    """Why torchao cannot train with these FP8 settings (one line naming the flag), or
    None. Needs no torch: the argument checks call it."""
    if options.recipe not in TORCHAO_RECIPES:
        return (
            f"--fp8-recipe {options.recipe} needs Transformer Engine (--transformer-impl "
            "transformer_engine); FP8 through torchao scales dynamically: use --fp8-recipe "
            "tensorwise or rowwise"
        )
    for name, default in _DELAYED_DEFAULTS.items():
        if getattr(options, name) != default:
            flag = "--fp8-" + name.replace("_", "-")
            return (
                f"{flag} applies to --fp8-recipe delayed (Transformer Engine); torchao's "
                f"{options.recipe} scaling has no amax history: drop {flag}"
            )
    if options.recipe == "rowwise" and options.format != "e4m3":
        return (
            "--fp8-recipe rowwise casts gradients to e4m3 (torchao's rowwise recipe): use "
            "--fp8-format e4m3"
        )
    return None


def float8_config(
    options: FP8Options, *, emulate: bool = False, fsdp_all_gather: bool = False
) -> Any:
    """torchao's `Float8LinearConfig` for Megatron's FP8 flags (table above). `emulate`:
    FP8 rounding with high-precision matmuls, for machines without FP8 matmuls (tests)."""
    why = refusal(options)
    if why is not None:
        raise ValueError(why)
    config = _import_torchao()
    cast, granularity, scaling = config.CastConfig, config.ScalingGranularity, config.ScalingType
    e4m3, e5m2 = config.e4m3_dtype, config.e5m2_dtype
    rowwise = options.recipe == "rowwise"
    if rowwise and not options.wgrad:
        recipe = config.Float8LinearRecipeName.ROWWISE_WITH_GW_HP
        base = config.Float8LinearConfig.from_recipe_name(recipe)
    elif rowwise:
        base = config.Float8LinearConfig.from_recipe_name(config.Float8LinearRecipeName.ROWWISE)
    else:
        grads = e5m2 if options.format == "hybrid" else e4m3

        def tensorwise(dtype: Any) -> Any:
            return cast(scaling_granularity=granularity.TENSORWISE, target_dtype=dtype)

        def high(dtype: Any) -> Any:  # the weight-gradient matmul's operands, --no-fp8-wgrad
            return None if options.wgrad else cast(scaling.DISABLED, target_dtype=dtype)

        base = config.Float8LinearConfig(
            cast_config_input=tensorwise(e4m3),
            cast_config_weight=tensorwise(e4m3),
            cast_config_grad_output=tensorwise(grads),
            cast_config_input_for_grad_weight=high(e4m3),
            cast_config_grad_output_for_grad_weight=high(grads),
        )
    if fsdp_all_gather and rowwise:
        raise ValueError(
            "--fp8-param-gather gathers FP8 weights with one scale per tensor: use "
            "--fp8-recipe tensorwise"
        )
    return dataclasses.replace(base, emulate=emulate, enable_fsdp_float8_all_gather=fsdp_all_gather)


def convert_to_float8(
    model: nn.Module,
    options: FP8Options,
    *,
    emulate: bool = False,
    fsdp_all_gather: bool = False,
) -> list[str]:
    """Swap the decoder layers' linears (outside `options.bf16_layers`) for torchao's
    `Float8Linear`s, in place; the weights are kept (same parameters). Returns the
    names converted."""
    config = float8_config(options, emulate=emulate, fsdp_all_gather=fsdp_all_gather)
    from torchao.float8 import convert_to_float8_training  # lazy: the fp8 extra

    converted: list[str] = []

    def wanted(module: nn.Module, name: str) -> bool:
        layer = _LAYER.search(name)
        ok = (
            type(module) is nn.Linear  # subclasses carry behaviour a swap would drop
            and layer is not None
            and int(layer.group(1)) not in options.bf16_layers
            and module.in_features % _MATMUL_MULTIPLE == 0
            and module.out_features % _MATMUL_MULTIPLE == 0
        )
        if ok:
            converted.append(name)
        return ok

    convert_to_float8_training(model, module_filter_fn=wanted, config=config)
    return converted


def bias_free_float8_linear(linear: type[nn.Module]) -> type[nn.Module] | None:
    """For torchao's `Float8Linear`: the subclass whose forward leaves the bias out, which
    a row-parallel split adds after reducing the partial products
    (`mg.core.parallel.row_parallel`); None for any other class."""
    if linear.__module__.split(".")[0] != "torchao":
        return None
    global _BIAS_FREE
    if _BIAS_FREE is None:
        _BIAS_FREE = _make_bias_free_float8_linear()
    return _BIAS_FREE if issubclass(_BIAS_FREE, linear) else None


_BIAS_FREE: type[nn.Module] | None = None


def _make_bias_free_float8_linear() -> type[nn.Module]:
    from torchao.float8.float8_linear import (  # lazy: the fp8 extra
        Float8Linear,
        matmul_with_hp_or_float8_args,
    )

    class BiasAfterReduceFloat8Linear(Float8Linear):
        """`Float8Linear.forward` (autocast's input cast, the FP8 matmul) without the bias."""

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            if torch.is_autocast_enabled():  # as Float8Linear: the GPU's autocast dtype
                input = input.to(torch.get_autocast_gpu_dtype())
            return matmul_with_hp_or_float8_args.apply(
                input, self.weight.t(), self.linear_mm_config, self.config
            )

    return BiasAfterReduceFloat8Linear


def torchao_installed() -> bool:
    return importlib.util.find_spec("torchao") is not None


def _import_torchao() -> Any:
    try:
        from torchao.float8 import config  # lazy: the fp8 extra
    except ImportError as err:
        raise Float8Unavailable(
            "--fp8-format without Transformer Engine trains through torchao, which is not "
            "installed; install the fp8 extra: pip install 'mg-core[fp8]'"
        ) from err
    return config
