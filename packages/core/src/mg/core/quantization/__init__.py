"""Quantized linear layers and what a quantized checkpoint records about them.

Shared by the tools: mg-quantize writes quantized checkpoints, mg-eval and
mg-serve load them through core's `load_model` (which calls
:func:`quantize_layout` when the checkpoint records a quantization).

    from mg.core.quantization import Int8WeightOnlyLinear, QuantizationConfig
"""

from mg.core.quantization.apply import (
    empty_quantized_linear,
    logits_through_output_module,
    parallel_load_refusal,
    quantize_layout,
    recorded_quantization,
    set_submodule,
)
from mg.core.quantization.config import INT4_RECIPES, RECIPES, QuantizationConfig
from mg.core.quantization.linear import (
    Fp8Linear,
    Int4WeightOnlyLinear,
    Int8DynamicLinear,
    Int8WeightOnlyLinear,
    QuantizedLinear,
    kernel_paths,
)
from mg.core.quantization.primitives import QuantizationError

__all__ = [
    "INT4_RECIPES",
    "RECIPES",
    "Fp8Linear",
    "Int4WeightOnlyLinear",
    "Int8DynamicLinear",
    "Int8WeightOnlyLinear",
    "QuantizationConfig",
    "QuantizationError",
    "QuantizedLinear",
    "empty_quantized_linear",
    "kernel_paths",
    "logits_through_output_module",
    "parallel_load_refusal",
    "quantize_layout",
    "recorded_quantization",
    "set_submodule",
]
