"""The vision tower: a ViT as Megatron-Core's `CLIPViTModel` builds it, CLIP or SigLIP.

Read top to bottom:

    pixels [b, 3, H, W] → conv1 (patch_dim × patch_dim, stride patch_dim) → patches [b, n, h]
      → (CLIP) class token prepended → + position_embeddings → (CLIP) ln_pre
      → N × TransformerLayer (bidirectional, pre-LN, biases on) → (SigLIP) ln_post

    clip:   class token, ln_pre, no conv bias, QuickGELU (x·σ(1.702x)), LayerNorm eps 1e-5
    siglip: no class token, conv bias, ln_post, GELU-tanh, LayerNorm eps 1e-6

Names are Megatron-Core's (`conv1`, `class_token`, `position_embeddings`, `ln_pre`,
`decoder.layers.{i}...`, `ln_post`); the layers are the GPT's `TransformerLayer` with
`causal=False`, so tensor parallelism, recompute and the checkpoint formats treat
them as they treat the language model's. Megatron's vision block has no final norm
(`post_process=False`), hence a plain `layers` list in `VisionTransformerBlock`.
CLIP's last hidden state is not normed (transformers' `post_layernorm` applies to
the pooled class token only, which LLaVA does not use); SigLIP's is.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mg.core.models.config import ConfigError, TransformerConfig
from mg.core.models.gpt import MLP, TransformerLayer

VisionModelType = Literal["clip", "siglip"]
VISION_MODEL_TYPES = ("clip", "siglip")


def quick_gelu(x: Tensor) -> Tensor:
    """CLIP's activation, x·σ(1.702x) (Megatron's `quick_gelu`, transformers' "quick_gelu")."""
    return x * torch.sigmoid(1.702 * x)


@dataclass
class VisionConfig:
    """The ViT's shape, with Megatron's flag names where it has one (`--img-h`,
    `--img-w`, `--patch-dim`, `--vision-model-type`, `--disable-vision-class-token`).

    `num_layers` counts the layers the LLaVA model runs: a checkpoint that feeds the
    projector from an inner layer (LLaVA's `vision_feature_layer = -2`) is imported
    with the layers after it left out, as Megatron's converters do."""

    vision_model_type: VisionModelType = "clip"
    num_layers: int = 24
    hidden_size: int = 1024
    num_attention_heads: int = 16
    ffn_hidden_size: int = 4096
    img_h: int = 336
    img_w: int = 336
    patch_dim: int = 14
    layernorm_epsilon: float | None = None
    """None: the type's own (CLIP 1e-5, SigLIP 1e-6)."""
    class_token_len: int = 1
    init_method_std: float = 0.02
    siglip_ln_post: bool = True
    """False: a SigLIP tower ends at its last layer, unnormed (a LLaVA that reads
    `hidden_states[layer]`, before SigLIP's post_layernorm)."""

    def __post_init__(self) -> None:
        if self.layernorm_epsilon is None:
            self.layernorm_epsilon = 1e-6 if self.vision_model_type == "siglip" else 1e-5
        self.validate()

    def validate(self) -> None:
        def fail(field: str, why: str) -> None:
            raise ConfigError(f"VisionConfig.{field}: {why}")

        if self.vision_model_type not in VISION_MODEL_TYPES:
            fail(
                "vision_model_type",
                f"{self.vision_model_type!r} is not one of {VISION_MODEL_TYPES}",
            )
        for name, size in (("img_h", self.img_h), ("img_w", self.img_w)):
            if size <= 0 or size % self.patch_dim:
                fail(name, f"{size} is not a positive multiple of patch_dim ({self.patch_dim})")
        if self.hidden_size % self.num_attention_heads:
            fail("num_attention_heads", f"{self.num_attention_heads} does not divide hidden_size")

    @property
    def add_class_token(self) -> bool:
        """SigLIP has no class token (Megatron asserts it)."""
        return self.vision_model_type != "siglip"

    @property
    def num_patches(self) -> int:
        return (self.img_h // self.patch_dim) * (self.img_w // self.patch_dim)

    @property
    def seq_length(self) -> int:
        """Tokens per image out of the tower: the patches and the class token(s)."""
        return self.num_patches + (self.class_token_len if self.add_class_token else 0)

    def transformer_config(self) -> TransformerConfig:
        """The layers' `TransformerConfig` (vocab_size is unused by a layer)."""
        return TransformerConfig(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            vocab_size=1,
            ffn_hidden_size=self.ffn_hidden_size,
            seq_length=self.seq_length,
            position_embedding_type="none",
            normalization="LayerNorm",
            layernorm_epsilon=self.layernorm_epsilon,
            # the MLP's activation is the tower's own (VisionMLP)
            activation="gelu_tanh" if self.vision_model_type == "siglip" else "gelu",
            add_bias_linear=True,
            init_method_std=self.init_method_std,
            attention_dropout=0.0,
            hidden_dropout=0.0,
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> VisionConfig:
        return cls(**values)


def gelu_tanh(x: Tensor) -> Tensor:
    """SigLIP's activation (transformers' "gelu_pytorch_tanh")."""
    return F.gelu(x, approximate="tanh")


VISION_ACTIVATIONS = {"clip": quick_gelu, "siglip": gelu_tanh}


class VisionMLP(MLP):
    """The GPT's MLP (`linear_fc1`, `linear_fc2`) with the tower's activation: CLIP's
    QuickGELU is not one a `TransformerConfig` names."""

    def __init__(self, config: TransformerConfig, activation: Callable[[Tensor], Tensor]) -> None:
        super().__init__(config)
        self.activation = activation

    def forward(self, hidden: Tensor) -> Tensor:
        return self.linear_fc2(self.activation(self.linear_fc1(hidden)))


class VisionTransformerBlock(nn.Module):
    """The ViT's layer stack (`decoder.layers`): bidirectional pre-LN layers, no final
    norm (Megatron's vision TransformerBlock is built with post_process=False)."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        layer_config = config.transformer_config()
        self.layers = nn.ModuleList(
            TransformerLayer(layer_config, layer_number=i + 1, causal=False)
            for i in range(config.num_layers)
        )
        activation = VISION_ACTIVATIONS[config.vision_model_type]
        for layer in self.layers:
            layer.mlp = VisionMLP(layer_config, activation)

    def forward(self, hidden: Tensor) -> Tensor:
        for layer in self.layers:
            hidden = layer(hidden)
        return hidden


class CLIPViTModel(nn.Module):
    """Images [b, 3, img_h, img_w] (normalised) → features [b, seq_length, hidden]."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        clip = config.vision_model_type == "clip"
        self.conv1 = nn.Conv2d(
            3, h, kernel_size=config.patch_dim, stride=config.patch_dim, bias=not clip
        )
        self.class_token = (
            nn.Parameter(torch.empty(1, config.class_token_len, h))
            if config.add_class_token
            else None
        )
        self.position_embeddings = nn.Embedding(config.seq_length, h)
        self.ln_pre = nn.LayerNorm(h, eps=config.layernorm_epsilon) if clip else None
        self.decoder = VisionTransformerBlock(config)
        post = not clip and config.siglip_ln_post
        self.ln_post = nn.LayerNorm(h, eps=config.layernorm_epsilon) if post else None
        if self.conv1.weight.device.type != "meta":
            self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """N(0, σ) for the patch embedding, class token and positions; Megatron's layer
        init (σ, and σ/√(2L) for the projections into the residual stream)."""
        std = self.config.init_method_std
        nn.init.normal_(self.conv1.weight, std=std)
        if self.conv1.bias is not None:
            nn.init.zeros_(self.conv1.bias)
        if self.class_token is not None:
            nn.init.normal_(self.class_token, std=std)
        nn.init.normal_(self.position_embeddings.weight, std=std)
        for norm in (self.ln_pre, self.ln_post):
            if norm is not None:
                norm.reset_parameters()
        output_std = std / math.sqrt(2 * self.config.num_layers)
        for layer in self.decoder.layers:
            layer.init_weights(std, output_std)

    def forward(self, images: Tensor) -> Tensor:
        x = self.conv1(images.to(self.conv1.weight.dtype))  # [b, h, grid_h, grid_w]
        x = x.flatten(2).transpose(1, 2)  # [b, patches, h]
        if self.class_token is not None:
            x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = x + self.position_embeddings.weight[: x.shape[1]]
        if self.ln_pre is not None:
            x = self.ln_pre(x)
        x = self.decoder(x)
        if self.ln_post is not None:
            x = self.ln_post(x)
        return x
