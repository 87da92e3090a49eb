"""``--export-format trtllm``: ModelOpt's unified Hugging Face checkpoint layout, which
TensorRT-LLM's ``LLM()`` API (and vLLM's ``modelopt`` loader) read: a Hugging Face
folder whose quantized linears hold ModelOpt's tensors, plus ``hf_quant_config.json``.

    int8_wo                  W8A16       int8 ``weight`` [out, in], ``weight_scale`` [out]
    int4_wo/awq/gptq (sym.)  W4A16_AWQ   ``weight`` uint8 [out/2, in]: the signed 4-bit
                                         values of rows 2r (low nibble) and 2r+1 (high)
                                         (ModelOpt's ``pack_int4_in_uint8``),
                                         ``weight_scale`` [out, in/g] fp16
    fp8 (per tensor)         FP8         E4M3 ``weight``, ``weight_scale`` and
                                         ``input_scale`` scalars (fp32)

AWQ's scales are already folded into the norms, so ``pre_quant_scale`` is false.
Checked structurally here (TensorRT-LLM does not run on this CPU); other recipes
(asymmetric int4, SmoothQuant's per-token activations, per-channel fp8) have no
matching ModelOpt algorithm and are refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from mg.core.models import TransformerConfig
from mg.core.models.hf_mapping import config_to_hf
from mg.core.quantization import (
    INT4_RECIPES,
    Fp8Linear,
    Int4WeightOnlyLinear,
    Int8WeightOnlyLinear,
    QuantizationConfig,
)
from mg.core.tokenizers.config import TokenizerConfig
from mg.quantize_export import __version__
from mg.quantize_export.errors import QuantizeInputError
from mg.quantize_export.hf_export import copy_hf_tokenizer, hf_state


def quant_algo(q: QuantizationConfig) -> str:
    if q.recipe == "int8_wo":
        return "W8A16"
    if q.recipe in INT4_RECIPES and q.symmetric:
        return "W4A16_AWQ"
    if q.recipe == "fp8" and not q.fp8_per_channel:
        return "FP8"
    raise QuantizeInputError(
        f"--export-format trtllm: ModelOpt has no layout for {q.recipe}"
        f"{' (asymmetric)' if not q.symmetric else ''}"
        f"{' (per-channel)' if q.fp8_per_channel else ''}; it takes int8_wo, symmetric "
        "int4 (int4_wo, int4_awq, int4_gptq) and per-tensor fp8"
    )


def pack_int4_in_uint8(signed: Tensor) -> Tensor:
    """[out, in] signed 4-bit values → uint8 [out/2, in], rows 2r low nibble, 2r+1 high."""
    nibbles = (signed.to(torch.int16) & 0x0F).to(torch.uint8)
    return (nibbles[0::2] | (nibbles[1::2] << 4)).contiguous()


def modelopt_tensors_of(module: nn.Module, rows: Tensor) -> dict[str, Tensor]:
    if isinstance(module, Int4WeightOnlyLinear):
        q = module.q_values()[rows]
        return {
            "weight": pack_int4_in_uint8(q.to(torch.int16) - 8),
            "weight_scale": module.weight_scale[rows].to(torch.float16).contiguous(),
        }
    if isinstance(module, Int8WeightOnlyLinear):
        return {
            "weight": module.qweight[rows].contiguous(),
            "weight_scale": module.weight_scale[rows].float().contiguous(),
        }
    if isinstance(module, Fp8Linear):
        return {
            "weight": module.fp8_weight()[rows].contiguous(),
            "weight_scale": module.weight_scale.float().reshape(()).clone(),
            "input_scale": module.input_scale.float().reshape(()).clone(),
        }
    raise TypeError(type(module).__name__)


def write_trtllm(
    folder: Path,
    model: nn.Module,
    config: TransformerConfig,
    tokenizer_config: TokenizerConfig | None,
    tokenizer_root: Path,
    quantization: QuantizationConfig,
) -> dict:
    algo = quant_algo(quantization)
    arch, state, ignore = hf_state(model, config, quantization, modelopt_tensors_of)
    quant = {"quant_algo": algo, "kv_cache_quant_algo": None}
    if algo == "W4A16_AWQ":
        quant.update(group_size=quantization.group_size, has_zero_point=False)
        quant["pre_quant_scale"] = False
    quant["exclude_modules"] = ignore
    hf_config = config_to_hf(config, arch)
    hf_config["torch_dtype"] = "float32"
    hf_config["quantization_config"] = {"quant_method": "modelopt", **quant}
    folder.mkdir(parents=True)
    save_file(
        {k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"),
        metadata={"format": "pt"},
    )  # fmt: skip
    (folder / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    producer = {"name": "mg-quantize", "version": __version__}
    (folder / "hf_quant_config.json").write_text(
        json.dumps({"producer": producer, "quantization": quant}, indent=2) + "\n"
    )
    copy_hf_tokenizer(tokenizer_config, tokenizer_root, folder)
    return {"format": "trtllm", "architecture": arch, "quant_algo": algo}
