"""The HF architectures mg-convert reads and writes: core's GPT-family tables plus Mamba-2.

`hf_mapping` holds the GPT family (GPT-2, Llama, Mistral, Qwen, BERT);
`Mamba2ForCausalLM` lives beside its model in `mg.core.models.mamba.hf` (same
table form, its own config mapping). These three functions are the one place
that picks between them, so import-hf and export-hf read any of them alike.
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
from mg.core.models.mamba.hf import MAMBA2, mamba2_config_from_hf, mamba2_config_to_hf

SUPPORTED_MODEL_TYPES = (*sorted(ARCHITECTURES), MAMBA2.model_type)


def hf_architecture(model_type: str | HFArchitecture) -> HFArchitecture:
    """The weight table of an HF `model_type` (ValueError names the known ones)."""
    if model_type == MAMBA2.model_type:
        return MAMBA2
    return get_architecture(model_type)


def model_config_of_hf(hf_config: dict[str, Any]) -> TransformerConfig:
    """config.json → our config (`MambaConfig` for Mamba-2, else `TransformerConfig`)."""
    if hf_config.get("model_type") == MAMBA2.model_type:
        return mamba2_config_from_hf(hf_config)
    return config_from_hf(hf_config)


def hf_config_of(config: TransformerConfig, model_type: str) -> dict[str, Any]:
    """Our config → config.json for `model_type`; ValueError if it cannot express it."""
    if model_type == MAMBA2.model_type:
        if not isinstance(config, MambaConfig):
            raise ValueError("only a Mamba model can be exported as Mamba2ForCausalLM")
        return mamba2_config_to_hf(config)
    if isinstance(config, MambaConfig):
        raise ValueError(f"a Mamba / hybrid model cannot be exported as {model_type!r}")
    return config_to_hf(config, model_type)
