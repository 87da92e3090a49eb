"""The model to quantize: an mg checkpoint (`torch` or `torch_dist`, any TP/PP, merged on
the fly by core's `load_model`) or a Hugging Face folder (config.json + safetensors,
mapped by core's `hf_mapping`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from mg.core.checkpoint import CheckpointError, load_model
from mg.core.models import GPTModel, TransformerConfig
from mg.core.models.hf_mapping import config_from_hf, get_architecture, hf_to_megatron
from mg.core.tokenizers.config import TokenizerConfig
from mg.quantize_export.errors import QuantizeInputError


@dataclass
class SourceModel:
    model: GPTModel
    config: TransformerConfig
    tokenizer_config: TokenizerConfig | None
    source: str
    """"mg" or "hf"."""


def is_hf_folder(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def load_source(path: str | Path) -> SourceModel:
    path = Path(path)
    if not path.is_dir():
        raise QuantizeInputError(f"--load {path}: no such folder")
    if is_hf_folder(path):
        return _load_hf(path)
    try:
        model, config, tokenizer_config, info = load_model(path)
    except CheckpointError as exc:
        raise QuantizeInputError(f"--load {path}: {exc}") from None
    if (info.extra.get("mg") or {}).get("quantization"):
        recipe = info.extra["mg"]["quantization"].get("recipe")
        raise QuantizeInputError(
            f"--load {path} is already quantized ({recipe}); quantize the float checkpoint "
            "it was made from"
        )
    return SourceModel(model, config, tokenizer_config, "mg")


def _load_hf(path: Path) -> SourceModel:
    hf_config = json.loads((path / "config.json").read_text())
    if hf_config.get("quantization_config"):
        raise QuantizeInputError(
            f"--load {path} is already quantized "
            f"({hf_config['quantization_config'].get('quant_method', '?')}); "
            "quantize the float model"
        )
    model_type = hf_config.get("model_type")
    try:
        arch = get_architecture(str(model_type))
        config = config_from_hf(hf_config, hidden_dropout=0.0, attention_dropout=0.0)
    except (KeyError, ValueError) as exc:
        raise QuantizeInputError(
            f"--load {path}: unsupported architecture {model_type!r}: {exc}"
        ) from None
    if arch.hf_class.startswith("Bert"):
        raise QuantizeInputError(
            f"--load {path}: unsupported architecture {model_type!r}: mg-quantize "
            "quantizes decoder language models (GPT-2, Llama, Mistral)"
        )
    hf_state: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        hf_state.update(load_file(file))
    try:
        weights = hf_to_megatron(hf_state, config, arch)
    except KeyError as exc:
        raise QuantizeInputError(f"--load {path}: {exc.args[0]}") from None
    with torch.device("meta"):
        model = GPTModel(config)
    model.load_state_dict(weights, strict=True, assign=True)
    config.extra = {**(config.extra or {}), "hf_model_type": model_type}
    tokenizer_config = None
    if (path / "tokenizer.json").is_file():
        tokenizer_config = TokenizerConfig("HuggingFaceTokenizer", tokenizer_model=str(path))
    return SourceModel(model.eval(), config, tokenizer_config, "hf")
