"""The HF architectures mg-convert reads and writes: core's GPT-family tables plus
Mamba-2 and Nemotron-H.

`hf_mapping` holds the GPT family (GPT-2, Llama, Mistral, Qwen, BERT, Gemma 3, and
gpt-oss with its stacked and MXFP4 experts through `mg.core.models.gpt_oss_hf`);
`Mamba2ForCausalLM` and `NemotronHForCausalLM` live beside their model in
`mg.core.models.mamba.hf` (same table form, their own config mappings; Nemotron-H's
table depends on the layer pattern, so it is built from the config). These
functions are the one place that picks between them, so import-hf and export-hf
read any of them alike.
"""

from __future__ import annotations

from typing import Any

from mg.core.models import TransformerConfig
from mg.core.models.hf_mapping import (
    ARCHITECTURES,
    HFArchitecture,
    config_from_hf,
    config_to_hf,
    get_architecture,
)
from mg.core.models.mamba import MambaConfig
from mg.core.models.mamba.hf import (
    MAMBA2,
    NEMOTRON_H_CLASS,
    NEMOTRON_H_TYPE,
    mamba2_config_from_hf,
    mamba2_config_to_hf,
    nemotron_h_architecture,
    nemotron_h_config_from_hf,
    nemotron_h_config_to_hf,
)

# llava: LlavaForConditionalGeneration, converted by llava_hf.py (its own tables);
# the vision towers alone by vision_tower_hf.py
SUPPORTED_MODEL_TYPES = (
    *sorted(ARCHITECTURES),
    MAMBA2.model_type,
    NEMOTRON_H_TYPE,
    "llava",
    "clip_vision_model",
    "siglip_vision_model",
)


def hf_architecture(
    model_type: str | HFArchitecture, config: TransformerConfig | None = None
) -> HFArchitecture:
    """The weight table of an HF `model_type` (ValueError names the known ones);
    Nemotron-H's needs the model's `config` (its layer pattern)."""
    if model_type == MAMBA2.model_type:
        return MAMBA2
    if model_type == NEMOTRON_H_TYPE:
        if not isinstance(config, MambaConfig):
            raise ValueError("NemotronHForCausalLM's weights need a Mamba / hybrid model config")
        return nemotron_h_architecture(config.layer_pattern)
    return get_architecture(model_type)


def hf_class_name(model_type: str) -> str:
    """The transformers class of an HF `model_type` (what `inspect` names)."""
    if model_type == NEMOTRON_H_TYPE:
        return NEMOTRON_H_CLASS
    return hf_architecture(model_type).hf_class


def model_config_of_hf(hf_config: dict[str, Any]) -> TransformerConfig:
    """config.json → our config (`MambaConfig` for Mamba-2 and Nemotron-H, else
    `TransformerConfig`)."""
    if hf_config.get("model_type") == MAMBA2.model_type:
        return mamba2_config_from_hf(hf_config)
    if hf_config.get("model_type") == NEMOTRON_H_TYPE:
        return nemotron_h_config_from_hf(hf_config)
    return config_from_hf(hf_config)


def hf_config_of(config: TransformerConfig, model_type: str) -> dict[str, Any]:
    """Our config → config.json for `model_type`; ValueError if it cannot express it."""
    if model_type in (MAMBA2.model_type, NEMOTRON_H_TYPE):
        if not isinstance(config, MambaConfig):
            raise ValueError(f"only a Mamba model can be exported as {model_type!r}")
        if model_type == MAMBA2.model_type:
            return mamba2_config_to_hf(config)
        return nemotron_h_config_to_hf(config)
    if isinstance(config, MambaConfig):
        raise ValueError(f"a Mamba / hybrid model cannot be exported as {model_type!r}")
    return config_to_hf(config, model_type)
