"""Swap a model's ``nn.Linear`` layers for the quantized modules a checkpoint records.

Used when loading: the model is built (on the meta device) from its config,
:func:`quantize_layout` puts empty quantized modules where the checkpoint has
quantized linears, and ``load_state_dict(assign=True)`` fills them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from mg.core.models.output_head import OutputModuleHead
from mg.core.quantization.config import INT4_RECIPES, QuantizationConfig
from mg.core.quantization.linear import (
    Fp8Linear,
    Int4WeightOnlyLinear,
    Int8DynamicLinear,
    Int8WeightOnlyLinear,
    QuantizedLinear,
)


def empty_quantized_linear(linear: nn.Linear, config: QuantizationConfig) -> QuantizedLinear:
    """An unfilled quantized module of the recipe's type, shaped like ``linear``."""
    args = (linear.in_features, linear.out_features, linear.bias is not None)
    with torch.device(linear.weight.device):
        if config.recipe == "int8_wo":
            return Int8WeightOnlyLinear(*args)
        if config.recipe in INT4_RECIPES:
            return Int4WeightOnlyLinear(*args, group_size=int(config.group_size or 128))
        if config.recipe == "int8_sq":
            return Int8DynamicLinear(*args)
        if config.recipe == "fp8":
            return Fp8Linear(*args, per_channel=config.fp8_per_channel)
    raise ValueError(f"unknown quantization recipe {config.recipe!r}")


def set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)
    if name == "output_layer" and hasattr(model, "output_head"):
        logits_through_output_module(model)


def logits_through_output_module(model: nn.Module) -> None:
    """A language model's logits normally come from its output weight (`output_weight()`,
    shared with the embedding or not); a quantized output layer has no float weight, so
    the model's head takes the logits from the module's own forward instead
    (`OutputModuleHead`; padding rows masked and the loss as before)."""
    model.output_head = OutputModuleHead()


def quantize_layout(model: nn.Module, config: QuantizationConfig) -> nn.Module:
    """Replace each linear named in ``config.modules`` by an empty quantized module (in place)."""
    for name in config.modules:
        linear = model.get_submodule(name)
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"{name} is a {type(linear).__name__}, not an nn.Linear")
        set_submodule(model, name, empty_quantized_linear(linear, config))
    return model


def recorded_quantization(state: Mapping[str, Any]) -> QuantizationConfig | None:
    """The quantization a checkpoint's state records, or None for a float checkpoint."""
    data = (state.get("mg") or {}).get("quantization")
    return QuantizationConfig.from_dict(dict(data)) if data else None


def parallel_load_refusal(load_dir: object, config: QuantizationConfig, tp: int, pp: int) -> str:
    """The one-line answer to a tensor/pipeline-parallel load of a quantized checkpoint.

    Quantized linears are not split: a column- or row-parallel shard of packed int4
    rows, group scales or a per-tensor fp8 scale is not what the TP layer code
    shards, and a quantized model is small enough to be read whole by each process.
    """
    return (
        f"{load_dir} is quantized by mg-quantize ({config.recipe}): quantized checkpoints "
        f"load whole on one process; run without --tensor-model-parallel-size and "
        f"--pipeline-model-parallel-size (asked for TP={tp}, PP={pp})"
    )
