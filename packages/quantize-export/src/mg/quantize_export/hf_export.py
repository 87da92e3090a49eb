"""``--export-format hf``: a Hugging Face folder in the compressed-tensors format (what
vLLM and transformers load), from mg's quantized modules without re-quantizing.

Formats (compressed-tensors names): ``int8_wo`` → ``int-quantized`` (int8 ``weight``,
``weight_scale`` [out, 1]); int4 recipes → ``pack-quantized`` (``weight_packed``: eight
4-bit values per int32 along the inputs, ``weight_scale`` [out, in/g],
``weight_zero_point`` packed along the outputs when asymmetric, ``weight_shape``);
``int8_sq`` → ``int-quantized`` with dynamic per-token int8 input activations; ``fp8``
→ ``float-quantized`` (E4M3 ``weight``, ``weight_scale``, static ``input_scale``).
compressed-tensors keeps int4 signed (q − 8 with zero point z − 8) and stores
``value + 8``: mg's unsigned q and z, as they are.

Rows go to q/k/v and gate/up by core's `hf_mapping` (an index tensor is mapped, then
used to pick rows of each quantized tensor), so scales follow their rows. Llama-family
models only: GPT-2's Conv1D layers are not what compressed-tensors targets.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from mg.core.models import TransformerConfig
from mg.core.models.hf_mapping import config_to_hf, megatron_to_hf
from mg.core.quantization import (
    Fp8Linear,
    Int4WeightOnlyLinear,
    Int8DynamicLinear,
    Int8WeightOnlyLinear,
    QuantizationConfig,
)
from mg.core.tokenizers.config import TokenizerConfig
from mg.quantize_export.errors import QuantizeInputError


def hf_architecture(config: TransformerConfig) -> str:
    model_type = (config.extra or {}).get("hf_model_type")
    if model_type in ("llama", "mistral", "qwen2"):
        return model_type
    if config.normalization == "RMSNorm" and config.position_embedding_type == "rope":
        return "mistral" if config.window_size is not None else "llama"
    raise QuantizeInputError(
        "--export-format hf/trtllm: Llama-family models only (RMSNorm, RoPE, SwiGLU); "
        "use --export-format gguf for GPT-2"
    )


def pack_int4_to_int32(values: Tensor, dim: int = 1) -> Tensor:
    """Unsigned 4-bit values (0..15) → int32 words of 8, element i in bits 4i..4i+3
    (compressed-tensors' ``pack_to_int32`` of the signed values, which adds 8 first)."""
    v = values.to(torch.int64)
    if dim == 0:
        v = v.t()
    rows, cols = v.shape
    if cols % 8:
        raise ValueError(f"pack_int4_to_int32: {cols} values per row is not a multiple of 8")
    shifts = torch.arange(8, dtype=torch.int64) * 4
    words = (v.reshape(rows, cols // 8, 8) << shifts).sum(dim=-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.t().contiguous() if dim == 0 else words


def _rows_of(name: str, out_features: int, config: TransformerConfig, arch: str) -> dict:
    """HF weight name → the rows of the mg linear ``name`` it is made of."""
    index = torch.arange(out_features, dtype=torch.float64)[:, None]
    mapped = megatron_to_hf({f"{name}.weight": index}, config, arch)
    return {hf: rows[:, 0].long() for hf, rows in mapped.items()}


def compressed_tensors_of(module: nn.Module, rows: Tensor) -> dict[str, Tensor]:
    """A quantized linear's tensors for the given rows, in compressed-tensors' names."""
    if isinstance(module, Int4WeightOnlyLinear):
        q = module.q_values()[rows]
        out = {
            "weight_packed": pack_int4_to_int32(q),
            "weight_scale": module.weight_scale[rows].float().contiguous(),
            "weight_shape": torch.tensor(list(q.shape), dtype=torch.int64),
        }
        zero = module.weight_zero_point[rows]
        if not bool((zero == 8).all()):
            out["weight_zero_point"] = pack_int4_to_int32(zero, dim=0)
        return out
    if isinstance(module, Int8WeightOnlyLinear | Int8DynamicLinear):
        return {
            "weight": module.qweight[rows].contiguous(),
            "weight_scale": module.weight_scale[rows].float()[:, None].contiguous(),
        }
    if isinstance(module, Fp8Linear):
        scale = module.weight_scale.float()
        return {
            "weight": module.fp8_weight()[rows].contiguous(),
            # per tensor: q, k and v (gate and up) each get a copy of the fused scale
            "weight_scale": (
                scale[rows][:, None] if module.per_channel else scale.reshape(1)
            ).clone(),
            "input_scale": module.input_scale.float().reshape(1).clone(),
        }
    raise TypeError(type(module).__name__)


def quantization_config(q: QuantizationConfig, ignore: list[str]) -> dict:
    weights: dict = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": False}
    inputs = None
    if q.recipe in ("int8_wo", "int8_sq"):
        weights.update(strategy="channel", group_size=None)
        fmt = "int-quantized"
        if q.recipe == "int8_sq":
            inputs = dict(
                num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True
            )  # fmt: skip
    elif q.recipe == "fp8":
        weights.update(type="float", strategy="channel" if q.fp8_per_channel else "tensor")
        inputs = dict(num_bits=8, type="float", symmetric=True, strategy="tensor", dynamic=False)
        fmt = "float-quantized"
    else:
        weights.update(
            num_bits=4, symmetric=q.symmetric, strategy="group", group_size=q.group_size
        )  # fmt: skip
        fmt = "pack-quantized"
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": inputs,
                "output_activations": None,
                "format": fmt,
            }
        },
        "ignore": ignore,
        "kv_cache_scheme": None,
    }


def hf_state(
    model: nn.Module,
    config: TransformerConfig,
    quantization: QuantizationConfig,
    tensors_of: Callable[[nn.Module, Tensor], dict[str, Tensor]] = compressed_tensors_of,
) -> tuple[str, dict[str, Tensor], list[str]]:
    """(architecture, HF state dict with each quantized linear's tensors as ``tensors_of``
    writes them for the given rows, HF linears kept in float)."""
    arch = hf_architecture(config)
    quantized = set(quantization.modules)
    floats: dict[str, Tensor] = {}
    out: dict[str, Tensor] = {}
    ignore: list[str] = []
    for name, tensor in model.state_dict().items():
        module_name = name.rpartition(".")[0]
        if module_name not in quantized:
            floats[name] = tensor
    for name in quantization.modules:
        module = model.get_submodule(name)
        for hf_name, rows in _rows_of(name, module.out_features, config, arch).items():
            prefix = hf_name.removesuffix(".weight")
            for key, value in tensors_of(module, rows).items():
                out[f"{prefix}.{key}"] = value
            if module.bias is not None:
                out[f"{prefix}.bias"] = module.bias.detach()[rows].contiguous()
    out.update(megatron_to_hf(floats, config, arch))
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            weight_rows = _rows_of(name, module.out_features, config, arch)
            ignore += [hf.removesuffix(".weight") for hf in weight_rows]
    if not config.untie_embeddings_and_output_weights:
        ignore.append("lm_head")
    return arch, out, sorted(set(ignore))


def write_hf(
    folder: Path,
    model: nn.Module,
    config: TransformerConfig,
    tokenizer_config: TokenizerConfig | None,
    tokenizer_root: Path,
    quantization: QuantizationConfig,
    extra_config: dict | None = None,
) -> dict:
    arch, state, ignore = hf_state(model, config, quantization)
    hf_config = config_to_hf(config, arch)
    hf_config["torch_dtype"] = "float32"
    hf_config["quantization_config"] = quantization_config(quantization, ignore)
    hf_config.update(extra_config or {})
    folder.mkdir(parents=True)
    save_file(
        {k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"),
        metadata={"format": "pt"},
    )  # fmt: skip
    (folder / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    copy_hf_tokenizer(tokenizer_config, tokenizer_root, folder)
    return {"format": "hf", "architecture": arch, "tensors": len(state)}


def copy_hf_tokenizer(config: TokenizerConfig | None, root: Path, folder: Path) -> None:
    if config is None:
        return
    resolve = lambda v: Path(v) if Path(v).is_absolute() else root / v  # noqa: E731
    if config.tokenizer_type == "HuggingFaceTokenizer" and config.tokenizer_model:
        source = resolve(config.tokenizer_model)
        for file in source.iterdir() if source.is_dir() else []:
            if file.name.startswith(("tokenizer", "special_tokens")) or file.suffix == ".txt":
                shutil.copy2(file, folder / file.name)
    elif config.tokenizer_type == "GPT2BPETokenizer" and config.vocab_file and config.merge_file:
        shutil.copy2(resolve(config.vocab_file), folder / "vocab.json")
        shutil.copy2(resolve(config.merge_file), folder / "merges.txt")
        settings = {"tokenizer_class": "GPT2Tokenizer", "model_max_length": 1024}
        (folder / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")
