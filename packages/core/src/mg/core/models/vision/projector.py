"""The vision projection: ViT features → the language model's hidden size.

Megatron-Core's `MultimodalProjector` with `--projector-type mlp` (LLaVA-1.5's
2-layer MLP): `encoder.linear_fc1` (vision hidden → ffn) → GELU → `encoder.linear_fc2`
(ffn → language hidden), biases on. transformers' `LlavaMultiModalProjector` is the
same with ffn = the language hidden size (`linear_1`, `linear_2`).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ProjectorType = Literal["mlp"]
PROJECTOR_TYPES = ("mlp",)


class ProjectorMLP(nn.Module):
    """linear_fc1 → exact GELU → linear_fc2, from `input_size` to `output_size`."""

    def __init__(self, input_size: int, ffn_hidden_size: int, output_size: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(input_size, ffn_hidden_size)
        self.linear_fc2 = nn.Linear(ffn_hidden_size, output_size)

    def forward(self, hidden: Tensor) -> Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(hidden)))


class MultimodalProjector(nn.Module):
    """`vision_projection` of a LLaVA model; the MLP is `encoder`, as Megatron names it."""

    def __init__(
        self, input_size: int, ffn_hidden_size: int, output_size: int, std: float = 0.02
    ) -> None:
        super().__init__()
        self.encoder = ProjectorMLP(input_size, ffn_hidden_size, output_size)
        self.std = std
        if self.encoder.linear_fc1.weight.device.type != "meta":
            self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """N(0, σ) weights, zero biases (Megatron's init of an MLP's linears)."""
        for linear in (self.encoder.linear_fc1, self.encoder.linear_fc2):
            nn.init.normal_(linear.weight, std=self.std)
            nn.init.zeros_(linear.bias)

    def forward(self, features: Tensor) -> Tensor:
        return self.encoder(features)
