"""Multi-token prediction (DeepSeek-V3's MTP): Megatron-Core's `MultiTokenPredictionBlock`.

Beside the next token, D sequential modules predict the tokens after it, each keeping
the causal chain. Depth k (1..D) at position i, with h_0 the decoder's output (after
its final norm):

    e_k = embedding(input_ids rolled left k times)          the model's own embedding
    h_k = final_layernorm(transformer_layer(eh_proj([enorm(e_k); hnorm(h_{k-1})])))
    loss_k[i] = cross-entropy(output_head(h_k[i]), labels[i + k])   the shared head

Rolling is Megatron's `roll_tensor` with context parallelism off: shift left by one,
the freed last position set to 0; the labels and the loss mask are rolled the same way,
so the positions past the end are masked out. The trainer averages each depth's masked
loss over its own tokens and adds `mtp_loss_scaling_factor / D` times their sum to the
main loss (`mg.trainer.family_gpt`).

Names are Megatron-Core's (`mtp.layers.{k}.enorm.weight`, `.hnorm`, `.eh_proj.weight`,
`.transformer_layer.…`, `.final_layernorm`), so checkpoints carry over. The transformer
layer is the decoder's last layer's kind (MoE where that one is) and is numbered after
the decoder's layers, as in Megatron (`num_layers + k`). Plain PyTorch, no process
groups: tensor parallelism shards `eh_proj` column-wise and gathers its output, and the
pipeline puts the block on the last stage (mg.core.parallel).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor, nn

from mg.core.models.config import TransformerConfig


def roll_left(tensor: Tensor) -> Tensor:
    """Megatron's `roll_tensor(t, shifts=-1, dims=-1)` without context parallelism: the
    sequence (last dimension) shifted left by one, its last position set to 0."""
    rolled = torch.roll(tensor, shifts=-1, dims=-1)
    rolled[..., -1] = 0
    return rolled


class MTPLosses(NamedTuple):
    """What a model with MTP returns beside its per-token loss (`forward(return_mtp=True)`)."""

    per_token: Tensor
    """Each depth's per-token cross-entropy [D, b, s], unmasked."""
    scaling_factor: float
    """The config's `mtp_loss_scaling_factor`: the depths' mean loss is added times this."""

    def depth_means(self, loss_mask: Tensor) -> list[Tensor]:
        """Each depth's masked mean loss, as Megatron averages it: depth k's mask is the
        loss mask rolled left k times, the mean is over its tokens (0 where it has none)."""
        means, mask = [], loss_mask.float()
        for depth in self.per_token:
            mask = roll_left(mask)
            means.append((depth.float() * mask).sum() / mask.sum().clamp(min=1))
        return means


class MultiTokenPredictionLayer(nn.Module):
    """Depth k of the block: [enorm(embedding); hnorm(hidden)] → eh_proj → transformer
    layer → final norm. `layer_number` is k (1-based)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        build_layer: Callable[[TransformerConfig, int], nn.Module],
        build_norm: Callable[[TransformerConfig], nn.Module],
    ) -> None:
        super().__init__()
        self.layer_number = layer_number
        self.enorm = build_norm(config)
        self.hnorm = build_norm(config)
        # [embedding; hidden] (Megatron's order) → hidden; no bias, as Megatron's
        self.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.transformer_layer = build_layer(config, config.num_layers + layer_number)
        self.final_layernorm = build_norm(config)

    def init_weights(self, std: float, output_std: float) -> None:
        """Megatron's: norms at 1 (bias 0), eh_proj N(0, σ), the layer as a decoder layer."""
        for norm in (self.enorm, self.hnorm, self.final_layernorm):
            norm.reset_parameters()
        nn.init.normal_(self.eh_proj.weight, mean=0.0, std=std)
        self.transformer_layer.init_weights(std, output_std)

    def forward(
        self,
        hidden: Tensor,
        embedded: Tensor,
        rotary: tuple[Tensor, ...] | None,
        attention_mask: Tensor | None,
        inference_cache: object | None = None,
    ) -> Tensor:
        """`inference_cache`: a cache for the transformer layer's keys and values when the
        depth drafts tokens for speculative decoding (mg-serve); None in training."""
        combined = torch.cat((self.enorm(embedded), self.hnorm(hidden)), dim=-1)
        combined = self.eh_proj(combined)
        if inference_cache is None:
            hidden = self.transformer_layer(combined, rotary, attention_mask)
        else:
            hidden = self.transformer_layer(combined, rotary, attention_mask, inference_cache)
        return self.final_layernorm(hidden)


class MultiTokenPredictionBlock(nn.Module):
    """The D MTP depths (`mtp_num_layers`) in sequence; `layers` as Megatron names them."""

    def __init__(
        self,
        config: TransformerConfig,
        build_layer: Callable[[TransformerConfig, int], nn.Module],
        build_norm: Callable[[TransformerConfig], nn.Module],
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            MultiTokenPredictionLayer(config, k + 1, build_layer, build_norm)
            for k in range(config.mtp_num_layers)
        )

    def forward(
        self,
        hidden: Tensor,
        input_ids: Tensor,
        position_ids: Tensor,
        embedding: nn.Module,
        rotary: tuple[Tensor, ...] | None,
        attention_mask: Tensor | None,
    ) -> list[Tensor]:
        """The decoder's output [b, s, h] → each depth's final hidden states [b, s, h].

        `embedding(input_ids, position_ids)` is the model's embedding (shared, as in
        Megatron); token and position ids are rolled left once per depth, the rotary
        tables and the attention mask stay the decoder's."""
        outputs = []
        for layer in self.layers:
            input_ids, position_ids = roll_left(input_ids), roll_left(position_ids)
            hidden = layer(hidden, embedding(input_ids, position_ids), rotary, attention_mask)
            outputs.append(hidden)
        return outputs
