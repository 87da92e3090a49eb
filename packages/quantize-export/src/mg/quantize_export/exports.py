"""``--export-format``: a deployable copy of the quantized model inside ``--save``."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from mg.core.models import TransformerConfig
from mg.core.quantization import QuantizationConfig
from mg.core.tokenizers.config import TokenizerConfig
from mg.quantize_export.gguf_export import check_gguf_model, default_gguf_type, write_gguf
from mg.quantize_export.hf_export import hf_architecture, write_hf
from mg.quantize_export.trtllm_export import quant_algo, write_trtllm


def check_export(
    fmt: str, model: nn.Module, config: TransformerConfig, quantization: QuantizationConfig
) -> None:
    """Refuse (QuantizeInputError) before quantizing what the export could not write."""
    if fmt == "gguf":
        check_gguf_model(model, config)
    else:
        hf_architecture(config)
    if fmt == "trtllm":
        quant_algo(quantization)


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
