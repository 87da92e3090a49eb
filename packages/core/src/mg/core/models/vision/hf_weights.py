"""transformers' CLIP/SigLIP vision towers and LLaVA projector ⇄ Megatron-Core names.

    embeddings.patch_embedding            ⇄ conv1
    embeddings.class_embedding [h]        ⇄ class_token [1, 1, h]
    embeddings.position_embedding         ⇄ position_embeddings
    pre_layrnorm (CLIP; sic)              ⇄ ln_pre
    encoder.layers.{i}.layer_norm1        ⇄ decoder.layers.{i}.input_layernorm
    encoder.layers.{i}.self_attn.{q,k,v}_proj ⇄ decoder.layers.{i}.self_attention.linear_qkv
                                             (Megatron's per-head [q; k; v] interleave)
    encoder.layers.{i}.self_attn.out_proj ⇄ decoder.layers.{i}.self_attention.linear_proj
    encoder.layers.{i}.layer_norm2        ⇄ decoder.layers.{i}.pre_mlp_layernorm
    encoder.layers.{i}.mlp.fc1 / fc2      ⇄ decoder.layers.{i}.mlp.linear_fc1 / linear_fc2
    post_layernorm (SigLIP)               ⇄ ln_post
    multi_modal_projector.linear_1 / _2   ⇄ vision_projection.encoder.linear_fc1 / _fc2

CLIP's `post_layernorm` norms the pooled class token only, which a LLaVA model never
reads; SigLIP's attention-pooling `head` likewise, and its `post_layernorm` where the
tower has no `ln_post` (`VisionConfig.siglip_ln_post`: LLaVA reads an unnormed layer):
none has a Megatron name and all are left out. Layers past `VisionConfig.num_layers`
(LLaVA reads layer -2) too.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mg.core.models.config import ConfigError
from mg.core.models.hf_mapping import interleave_qkv, split_qkv
from mg.core.models.vision.vit import VisionConfig

_LAYER_COPIES = {
    "input_layernorm": "layer_norm1",
    "self_attention.linear_proj": "self_attn.out_proj",
    "pre_mlp_layernorm": "layer_norm2",
    "mlp.linear_fc1": "mlp.fc1",
    "mlp.linear_fc2": "mlp.fc2",
}


def vision_config_from_hf(
    hf_config: Any, num_layers: int | None = None, img_size: int | None = None
) -> VisionConfig:
    """A `CLIPVisionConfig` / `SiglipVisionConfig` (object or dict) → `VisionConfig`;
    `num_layers` keeps only the first layers (LLaVA's vision_feature_layer)."""
    c = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
    model_type = c.get("model_type", "")
    if "siglip" in model_type:
        vision_type, activation = "siglip", "gelu_pytorch_tanh"
    elif "clip" in model_type:
        vision_type, activation = "clip", "quick_gelu"
    else:
        raise ConfigError(f"vision_config.model_type: {model_type!r} is not a CLIP or SigLIP tower")
    if c.get("hidden_act", activation) != activation:
        raise ConfigError(
            f"vision_config.hidden_act: {c['hidden_act']!r}; a {vision_type} tower computes "
            f"{activation!r}"
        )
    size = img_size or c["image_size"]
    return VisionConfig(
        vision_model_type=vision_type,
        num_layers=num_layers if num_layers is not None else c["num_hidden_layers"],
        hidden_size=c["hidden_size"],
        num_attention_heads=c["num_attention_heads"],
        ffn_hidden_size=c["intermediate_size"],
        img_h=size,
        img_w=size,
        patch_dim=c["patch_size"],
        layernorm_epsilon=c["layer_norm_eps"],
    )


def vision_from_hf(
    hf: dict[str, Tensor], config: VisionConfig, prefix: str = ""
) -> dict[str, Tensor]:
    """The vision tower's HF tensors (keys under `prefix`) → `CLIPViTModel`'s state dict."""
    layer_config = config.transformer_config()
    out = {
        "conv1.weight": hf[f"{prefix}embeddings.patch_embedding.weight"],
        "position_embeddings.weight": hf[f"{prefix}embeddings.position_embedding.weight"],
    }
    if config.vision_model_type == "clip":
        out["class_token"] = hf[f"{prefix}embeddings.class_embedding"].reshape(1, 1, -1)
        for p in ("weight", "bias"):
            out[f"ln_pre.{p}"] = hf[f"{prefix}pre_layrnorm.{p}"]
    else:
        out["conv1.bias"] = hf[f"{prefix}embeddings.patch_embedding.bias"]
        for p in ("weight", "bias") if config.siglip_ln_post else ():
            out[f"ln_post.{p}"] = hf[f"{prefix}post_layernorm.{p}"]
    for i in range(config.num_layers):
        src, dst = f"{prefix}encoder.layers.{i}.", f"decoder.layers.{i}."
        for p in ("weight", "bias"):
            q, k, v = (hf[f"{src}self_attn.{n}_proj.{p}"] for n in "qkv")
            out[f"{dst}self_attention.linear_qkv.{p}"] = interleave_qkv(q, k, v, layer_config)
            for ours, theirs in _LAYER_COPIES.items():
                out[f"{dst}{ours}.{p}"] = hf[f"{src}{theirs}.{p}"]
    return {k: v.contiguous() for k, v in out.items()}


def vision_to_hf(state: dict[str, Tensor], config: VisionConfig, prefix: str = "") -> dict:
    """Inverse of `vision_from_hf` (CLIP's unused post_layernorm written as the identity,
    so transformers loads the folder without missing keys)."""
    layer_config = config.transformer_config()
    out = {
        f"{prefix}embeddings.patch_embedding.weight": state["conv1.weight"],
        f"{prefix}embeddings.position_embedding.weight": state["position_embeddings.weight"],
    }
    h = config.hidden_size
    if config.vision_model_type == "clip":
        out[f"{prefix}embeddings.class_embedding"] = state["class_token"].reshape(-1)
        for p in ("weight", "bias"):
            out[f"{prefix}pre_layrnorm.{p}"] = state[f"ln_pre.{p}"]
        dtype = state["conv1.weight"].dtype
        out[f"{prefix}post_layernorm.weight"] = torch.ones(h, dtype=dtype)
        out[f"{prefix}post_layernorm.bias"] = torch.zeros(h, dtype=dtype)
    else:  # without ln_post (siglip_ln_post false) SigLIP's post_layernorm is not ours
        out[f"{prefix}embeddings.patch_embedding.bias"] = state["conv1.bias"]
        for p in ("weight", "bias") if config.siglip_ln_post else ():
            out[f"{prefix}post_layernorm.{p}"] = state[f"ln_post.{p}"]
    for i in range(config.num_layers):
        src, dst = f"decoder.layers.{i}.", f"{prefix}encoder.layers.{i}."
        for p in ("weight", "bias"):
            q, k, v = split_qkv(state[f"{src}self_attention.linear_qkv.{p}"], layer_config)
            for name, t in zip("qkv", (q, k, v), strict=True):
                out[f"{dst}self_attn.{name}_proj.{p}"] = t
            for ours, theirs in _LAYER_COPIES.items():
                out[f"{dst}{theirs}.{p}"] = state[f"{src}{ours}.{p}"]
    return {k: v.contiguous() for k, v in out.items()}


def projector_from_hf(hf: dict[str, Tensor], prefix: str = "") -> dict[str, Tensor]:
    """LLaVA's `multi_modal_projector` (keys under `prefix`) → `MultimodalProjector`'s."""
    return {
        f"encoder.linear_fc{n}.{p}": hf[f"{prefix}linear_{n}.{p}"]
        for n in (1, 2)
        for p in ("weight", "bias")
    }


def projector_to_hf(state: dict[str, Tensor], prefix: str = "") -> dict[str, Tensor]:
    return {
        f"{prefix}linear_{n}.{p}": state[f"encoder.linear_fc{n}.{p}"]
        for n in (1, 2)
        for p in ("weight", "bias")
    }
