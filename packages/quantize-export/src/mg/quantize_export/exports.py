"""``--export-format``: a deployable copy of the quantized model inside ``--save``."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from mg.core.models import TransformerConfig
from mg.core.quantization import QuantizationConfig
from mg.core.tokenizers.config import TokenizerConfig
from mg.quantize_export.errors import QuantizeInputError
from mg.quantize_export.gguf_export import default_gguf_type, gguf_architecture, write_gguf
from mg.quantize_export.hf_export import hf_architecture, write_hf
from mg.quantize_export.trtllm_export import quant_algo, write_trtllm

# What each exporter reads from every decoder layer: part -> attributes it must have.
# An MoE layer (router + experts, no linear_fc1), q/k norms or, for GGUF, norms fused
# into the next linear (Transformer Engine's layer spec) are not what they write.
_HF_PARTS = {"self_attention": ("linear_qkv", "linear_proj"), "mlp": ("linear_fc1", "linear_fc2")}
_GGUF_PARTS = {**_HF_PARTS, "input_layernorm": ("weight",), "pre_mlp_layernorm": ("weight",)}


def unexported_family(config: TransformerConfig) -> tuple[str, str] | None:
    """(family, what no exporter here writes) for a model of the newer families, whose
    layers none of the three layouts has names for; None for the others."""
    if config.multi_latent_attention:
        return "DeepSeek-V3", "multi-latent attention, routed and shared experts"
    if (
        config.softmax_type != "vanilla"
        or config.activation == "quick_geglu"
        or config.activation_func_clamp_value is not None
    ):
        return "gpt-oss", "attention sinks, clamped GLU experts with biases"
    if config.sandwich_norms or config.rotary_base_local is not None:
        return "Gemma 3", "sandwich norms, q/k norms, local/global RoPE bases"
    return None


def check_export(
    fmt: str, model: nn.Module, config: TransformerConfig, quantization: QuantizationConfig
) -> None:
    """Refuse (QuantizeInputError) before quantizing what the export could not write."""
    family = unexported_family(config)
    if family is not None:
        name, parts = family
        raise QuantizeInputError(
            f"--export-format {fmt}: a {name} model ({parts}) is not written by the {fmt} "
            f"export; drop --export-format {fmt} (the quantized mg checkpoint serves with "
            "mg-serve)"
        )
    if fmt == "gguf":
        gguf_architecture(config)
    else:
        hf_architecture(config)
    _refuse_unwritable_layers(fmt, model, _GGUF_PARTS if fmt == "gguf" else _HF_PARTS)
    if fmt == "trtllm":
        quant_algo(quantization)


def _refuse_unwritable_layers(fmt: str, model: nn.Module, parts: dict) -> None:
    """Name the first layer part the exporter cannot write (it would crash at the end of
    the run, after calibration and quantization)."""
    layers = getattr(getattr(model, "decoder", None), "layers", None)
    for i, layer in enumerate(layers if layers is not None else ()):
        for part, needs in parts.items():
            module = getattr(layer, part, None)
            qk_norms = getattr(module, "q_layernorm", None) is not None
            if qk_norms or any(getattr(module, need, None) is None for need in needs):
                kind = type(module).__name__ + (" with q/k norms" if qk_norms else "")
                raise QuantizeInputError(
                    f"--export-format {fmt}: decoder.layers.{i}.{part} ({kind}) cannot be "
                    f"written: the {fmt} export writes dense layers (attention, an MLP"
                    + (", norms as modules" if fmt == "gguf" else "")
                    + f"); drop --export-format {fmt} (the quantized checkpoint is still "
                    "written)"
                )


def export(
    fmt: str,
    folder: Path,
    model: nn.Module,
    config: TransformerConfig,
    tokenizer_config: TokenizerConfig | None,
    quantization: QuantizationConfig,
    gguf_type: str | None,
) -> dict:
    """Write ``folder/<fmt>/...``; returns what was written, for the report."""
    if fmt == "gguf":
        kind = gguf_type or default_gguf_type(quantization.recipe, quantization.symmetric)
        (folder / "gguf").mkdir()
        path = folder / "gguf" / f"model-{kind}.gguf"
        info = write_gguf(path, model, config, tokenizer_config, folder, kind)
        info["path"] = str(Path("gguf") / path.name)
        return {k: v for k, v in info.items() if k != "tensor_types"}
    if fmt == "hf":
        info = write_hf(folder / "hf", model, config, tokenizer_config, folder, quantization)
        return {**info, "path": "hf"}
    if fmt == "trtllm":
        info = write_trtllm(
            folder / "trtllm", model, config, tokenizer_config, folder, quantization
        )  # fmt: skip
        return {**info, "path": "trtllm"}
    raise ValueError(f"unknown export format {fmt!r}")
