"""Retro: a GPT decoder that attends, chunk by chunk, to text retrieved from a database.

Megatron-Core's RetroModel (megatron.core.models.retro, up to 0.15) with its local
layer spec, read top to bottom. A sample of ns tokens is cut into l = ⌈ns/m⌉ chunks
of m = `retro_chunk_length` tokens; each chunk comes with k = `retro_num_neighbors`
neighbours of r = `retro_retrieved_length` tokens (a neighbour chunk and its
continuation) from the retrieval database (`mg-prep retro`, `mg.core.retro`).

    embedding(tokens) ─▶ decoder layers 1 … L ─▶ output layer (no final norm)
    embedding(neighbours) ───────┐   (the same embedding)
                                 ▼
    decoder layer 6 (or 9 when L > 15), then every third layer (Megatron's rule):
        x = x + self_attention(input_layernorm(x))
        h = pre_cross_attn_layernorm(x)
        (first such layer) context = encoder(neighbours, cross-attending to h's chunks)
        x = x + gate · chunked_cross_attention(h, context)
        x = x + mlp(pre_mlp_layernorm(x))
    the other decoder layers are GPT's TransformerLayer, unchanged.

The Retro encoder (`cross_attention.encoder` of the first Retro layer) is a stack of
`retro_encoder_num_layers` bidirectional layers over each neighbour's r tokens, with
its own dropouts and no final norm; its first layer also cross-attends from each
neighbour to the hidden states of the chunk it was retrieved for. Chunked cross
attention lets the tokens from the last token of chunk i on attend to chunk i's
encoded neighbours (causal: a chunk never sees its own neighbours before its end).

Parameter names are Megatron-Core's: `decoder.layers.{i}.pre_cross_attn_layernorm`,
`decoder.layers.{i}.cross_attention.attn.{linear_q, linear_kv, linear_proj}`,
`decoder.layers.{i}.cross_attention.encoder.layers.{j}.…`, the encoder's first layer's
`pre_mlp_layernorm.norm`. A GPTModel's state dict loads into the GPT part unchanged
(Retro-fitting, below).

Megatron-Core's Retro decoder has no final norm (its block spec names none), so
neither has this one; a GPT checkpoint's `decoder.final_layernorm` is left out when
Retro-fitting: `load_state_dict` of a GPTModel's state dict takes its GPT weights and
keeps the Retro weights as initialised (a load pre-hook, so any loader does it).

Neighbour rows: the embedded neighbours come as Megatron orders them, row
(b·l + i)·k + j for chunk i of sample b and neighbour j; the encoder's first
cross-attention hands them on neighbour-major (row j·b·l + (b·l + i)), as Megatron's
RetroEncoderBiasDropoutAdd stacks them, and the decoder attends from chunk i to its k·r
encoded tokens.

`retro_attention_gate` scales the chunked cross-attention output before its residual
add, as Megatron's legacy Retro does (Megatron-Core accepts the flag and ignores it:
equal at its default, 1).

Plain PyTorch, no process groups.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mg.core.models.config import ConfigError, TransformerConfig
from mg.core.models.gpt import GPTModel, TransformerLayer, build_norm, normed_call
from mg.core.models.language_model import InitUnit
from mg.core.models.t5 import CrossAttention


@dataclass
class RetroConfig(TransformerConfig):
    """A GPT config plus Retro's fields (Megatron-Core's RetroConfig names)."""

    retro_chunk_length: int = 64
    """m: tokens per chunk (`--retro-gpt-chunk-length` of the project)."""
    retro_encoder_num_layers: int = 2
    """Layers of the neighbour encoder (`--retro-encoder-layers`)."""
    retro_encoder_hidden_dropout: float = 0.1
    retro_encoder_attention_dropout: float = 0.1
    retro_num_neighbors: int = 2
    """k: neighbours per chunk (`--retro-num-neighbors`)."""
    retro_num_retrieved_chunks: int = 2
    """Chunks per neighbour: the neighbour and its continuation(s)."""
    retro_attention_gate: float = 1.0
    """Scale of the chunked cross-attention output (`--retro-attention-gate`)."""

    @property
    def retro_retrieved_length(self) -> int:
        """r: tokens per retrieved neighbour (chunks × chunk length)."""
        return self.retro_num_retrieved_chunks * self.retro_chunk_length

    @property
    def retro_layer_numbers(self) -> list[int]:
        """The decoder layers with chunked cross-attention (1-based): from 6, or 9 with
        more than 15 layers, every third (Megatron's `get_retro_decoder_block_spec`)."""
        start = 6 if self.num_layers <= 15 else 9
        return list(range(start, self.num_layers + 1, 3))

    def encoder_config(self) -> TransformerConfig:
        """The encoder's layers: this config with the encoder's dropouts."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(TransformerConfig)}
        fields["hidden_dropout"] = self.retro_encoder_hidden_dropout
        fields["attention_dropout"] = self.retro_encoder_attention_dropout
        return TransformerConfig(**fields)

    def validate(self) -> None:
        super().validate()

        def fail(name: str, message: str) -> None:
            raise ConfigError(f"RetroConfig.{name}: {message}")

        if not self.retro_layer_numbers:
            fail(
                "num_layers",
                f"Retro places chunked cross-attention from decoder layer "
                f"{6 if self.num_layers <= 15 else 9} on; got {self.num_layers} layers "
                "(use --num-layers 6 or more)",
            )
        for name in (
            "retro_chunk_length",
            "retro_encoder_num_layers",
            "retro_num_neighbors",
            "retro_num_retrieved_chunks",
        ):
            if getattr(self, name) < 1:
                fail(name, f"must be at least 1, got {getattr(self, name)}")
        if self.num_query_groups != self.num_attention_heads:
            fail("num_query_groups", "Retro's cross attention has no grouped-query form")
        if self.mtp_num_layers:
            fail("mtp_num_layers", "multi-token prediction is not implemented for Retro")
        if self.num_moe_experts or self.multi_latent_attention:
            fail("num_moe_experts", "Retro's layers are dense GPT layers (no MoE, no MLA)")


# --- the encoder over the retrieved neighbours -------------------------------------------


class RetroEncoderLayerNorm(nn.Module):
    """Megatron's per-neighbour pre-MLP norm: a norm of each row, its parameters under
    `.norm` (Megatron applies it neighbour by neighbour; a row-wise norm is the same)."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.norm = build_norm(config)

    def reset_parameters(self) -> None:
        self.norm.reset_parameters()

    def forward(self, hidden: Tensor) -> Tensor:
        return self.norm(hidden)


class RetroEncoderCrossAttention(nn.Module):
    """Each neighbour attends to the decoder's hidden states of the chunk it was
    retrieved for; the residual is the normed neighbour (Megatron's encoder BDA)."""

    def __init__(self, config: RetroConfig, layer_number: int) -> None:
        super().__init__()
        self.attn = CrossAttention(config, layer_number)
        self.num_neighbors = config.retro_num_neighbors

    def init_weights(self, std: float, output_std: float) -> None:
        self.attn.init_weights(std, output_std)

    def forward(self, neighbours: Tensor, chunks: Tensor, dropout: nn.Dropout) -> Tensor:
        """neighbours [b·l·k, r, d] (row (b·l + i)·k + j: chunk i's neighbour j),
        chunks [b·l, m, d] → [b·l·k, r, d] neighbour-major (row j·b·l + b·l + i)."""
        rows, r, d = neighbours.shape
        per_chunk = neighbours.view(rows // self.num_neighbors, self.num_neighbors, r, d)
        outputs = [
            dropout(self.attn(per_chunk[:, j], chunks, None)) + per_chunk[:, j]
            for j in range(self.num_neighbors)
        ]
        return torch.stack(outputs).reshape(rows, r, d)


class RetroEncoderLayer(TransformerLayer):
    """The encoder's first layer: bidirectional self-attention over each neighbour,
    cross-attention to its chunk, Megatron's per-neighbour norm, MLP."""

    def __init__(self, config: RetroConfig, layer_number: int) -> None:
        encoder = config.encoder_config()
        super().__init__(encoder, layer_number, causal=False)
        self.pre_cross_attn_layernorm = build_norm(encoder)
        # the cross attention's core attention keeps the decoder's attention dropout
        self.cross_attention = RetroEncoderCrossAttention(config, layer_number)
        self.pre_mlp_layernorm = RetroEncoderLayerNorm(encoder)

    def init_weights(self, std: float, output_std: float) -> None:
        super().init_weights(std, output_std)
        self.pre_cross_attn_layernorm.reset_parameters()
        self.cross_attention.init_weights(std, output_std)

    def forward(
        self, hidden: Tensor, chunks: Tensor, attention_mask: Tensor | None = None
    ) -> Tensor:
        attention = normed_call(
            self.input_layernorm,
            self.recompute_input_layernorm,
            lambda normed: self.self_attention(normed, None, attention_mask),
            hidden,
        )
        hidden = hidden + self.hidden_dropout(attention)
        normed = self.pre_cross_attn_layernorm(hidden)
        hidden = self.cross_attention(normed, chunks, self.hidden_dropout)
        mlp = normed_call(
            self.pre_mlp_layernorm, self.recompute_pre_mlp_layernorm, self.mlp, hidden
        )
        return hidden + self.hidden_dropout(mlp)


class RetroEncoderBlock(nn.Module):
    """`retro_encoder_num_layers` bidirectional layers, the first a RetroEncoderLayer;
    no final norm (Megatron builds the encoder with post_process=False)."""

    def __init__(self, config: RetroConfig) -> None:
        super().__init__()
        encoder = config.encoder_config()
        self.layers = nn.ModuleList(
            [RetroEncoderLayer(config, 1)]
            + [
                TransformerLayer(encoder, i + 1, causal=False)
                for i in range(1, config.retro_encoder_num_layers)
            ]
        )

    def init_weights(self, std: float, output_std: float) -> None:
        for layer in self.layers:
            layer.init_weights(std, output_std)

    def forward(
        self, neighbours: Tensor, chunks: Tensor, attention_mask: Tensor | None = None
    ) -> Tensor:
        (hidden,) = self.run_layers(list(self.layers), (neighbours,), chunks, attention_mask)
        return hidden

    def run_layers(
        self,
        layers: list[nn.Module],
        carried: tuple[Tensor],
        chunks: Tensor,
        attention_mask: Tensor | None,
    ) -> tuple[Tensor]:
        """`layers` (a run of this block's) on the neighbours' hidden states `carried`;
        full recompute checkpoints such runs (`mg.core.models.recompute`)."""
        (hidden,) = carried
        for layer in layers:
            if isinstance(layer, RetroEncoderLayer):
                hidden = layer(hidden, chunks, attention_mask)
            else:
                hidden = layer(hidden, None, attention_mask)
        return (hidden,)


# --- chunked cross-attention in the decoder ------------------------------------------------


def _chunks(hidden: Tensor, start: int, chunk_length: int, num_chunks: int) -> Tensor:
    """hidden [b, s, d] from `start` on, zero-padded to num_chunks·m → [b·l, m, d]."""
    b, s, d = hidden.shape
    tail = hidden[:, start:]
    padded = F.pad(tail, (0, 0, 0, num_chunks * chunk_length - tail.shape[1]))
    return padded.reshape(b * num_chunks, chunk_length, d)


def _decoder_context(encoded: Tensor, num_neighbors: int) -> Tensor:
    """The encoder output [k·b·l, r, d] (neighbour-major) → each chunk's keys and values
    [b·l, r·k, d], in Megatron's order (token t of neighbour j at t·k + j)."""
    rows, r, d = encoded.shape
    per_neighbour = encoded.view(num_neighbors, rows // num_neighbors, r, d)
    return per_neighbour.permute(1, 2, 0, 3).reshape(rows // num_neighbors, r * num_neighbors, d)


class RetroDecoderCrossAttention(nn.Module):
    """Chunked cross-attention; the first Retro layer also holds the encoder."""

    def __init__(self, config: RetroConfig, layer_number: int, with_encoder: bool) -> None:
        super().__init__()
        self.attn = CrossAttention(config, layer_number)
        self.encoder = RetroEncoderBlock(config) if with_encoder else None
        self.chunk_length = config.retro_chunk_length
        self.num_neighbors = config.retro_num_neighbors
        # the output's dropout, over the whole sequence (with sequence parallelism too:
        # it runs before the output is cut into the ranks' slices)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def init_weights(self, std: float, output_std: float) -> None:
        self.attn.init_weights(std, output_std)
        if self.encoder is not None:
            self.encoder.init_weights(std, output_std)

    def forward(
        self, hidden: Tensor, context: Tensor, context_mask: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """hidden [b, s, d] (normed, the whole sequence); context: the embedded neighbours
        [b·l·k, r, d] (first Retro layer) or the encoded ones [b·l, r·k, d]. Returns the
        attention output back in sequence order [b, s, d] (dropped out; 0 for the tokens
        before the first attending one) and the encoded context."""
        b, s, d = hidden.shape
        m = self.chunk_length
        num_chunks = math.ceil(s / m)
        if self.encoder is not None:
            # the decoder's chunks, a partial first chunk (s % m tokens) zero-padded at its end
            first = s % m
            if first:
                head = F.pad(hidden[:, :first], (0, 0, 0, m - first))
                chunked = torch.cat([head, hidden[:, first:]], dim=1)
            else:
                chunked = hidden
            chunked = chunked.reshape(b * num_chunks, m, d)
            context = _decoder_context(
                self.encoder(context, chunked, context_mask), self.num_neighbors
            )
        # token t attends to the neighbours of the chunk that ended at or before it
        pad = (s - 1) % m
        attending = _chunks(hidden, pad, m, num_chunks)
        per_chunk = self.dropout(self.attn(attending, context, None)).reshape(b, -1, d)
        return F.pad(per_chunk, (0, 0, pad, 0))[:, :s], context


class RetroDecoderLayer(TransformerLayer):
    """A GPT layer with chunked cross-attention between self-attention and the MLP."""

    def __init__(self, config: RetroConfig, layer_number: int, with_encoder: bool) -> None:
        super().__init__(config, layer_number)
        self.pre_cross_attn_layernorm = build_norm(config)
        self.cross_attention = RetroDecoderCrossAttention(config, layer_number, with_encoder)
        self.attention_gate = config.retro_attention_gate

    def init_weights(self, std: float, output_std: float) -> None:
        super().init_weights(std, output_std)
        self.pre_cross_attn_layernorm.reset_parameters()
        self.cross_attention.init_weights(std, output_std)

    def forward(
        self,
        hidden: Tensor,
        rotary: tuple[Tensor, Tensor] | None,
        attention_mask: Tensor | None,
        context: Tensor,
        context_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        attention = normed_call(
            self.input_layernorm,
            self.recompute_input_layernorm,
            lambda normed: self.self_attention(normed, rotary, attention_mask),
            hidden,
        )
        hidden = hidden + self.hidden_dropout(attention)
        cross, context = self.cross_attention(
            self.pre_cross_attn_layernorm(hidden), context, context_mask
        )
        hidden = self.attention_gate * cross + hidden
        mlp = normed_call(
            self.pre_mlp_layernorm, self.recompute_pre_mlp_layernorm, self.mlp, hidden
        )
        return hidden + self.hidden_dropout(mlp), context


class RetroDecoderBlock(nn.Module):
    """GPT layers and Retro layers at `retro_layer_numbers`; no final norm: Megatron-
    Core's Retro block spec names none (`final_layernorm` is None there, and so here)."""

    def __init__(self, config: RetroConfig) -> None:
        super().__init__()
        retro = config.retro_layer_numbers
        self.layers = nn.ModuleList(
            RetroDecoderLayer(config, n, with_encoder=n == retro[0])
            if n in retro
            else TransformerLayer(config, n)
            for n in range(1, config.num_layers + 1)
        )
        self.final_layernorm = None

    def forward(
        self,
        hidden: Tensor,
        rotary: tuple[Tensor, Tensor] | None = None,
        attention_mask: Tensor | None = None,
        context: Tensor | None = None,
        context_mask: Tensor | None = None,
    ) -> Tensor:
        if context is None:
            raise ValueError("RetroModel needs the neighbours' token ids (context_input_ids)")
        hidden, _ = self.run_layers(
            list(self.layers), (hidden, context), rotary, attention_mask, context_mask
        )
        return hidden

    def run_layers(
        self,
        layers: list[nn.Module],
        carried: tuple[Tensor, Tensor],
        rotary: tuple[Tensor, Tensor] | None,
        attention_mask: Tensor | None,
        context_mask: Tensor | None,
    ) -> tuple[Tensor, Tensor]:
        """`layers` (a run of this block's) on `carried` = (hidden states, neighbours:
        embedded until the first Retro layer encodes them); full recompute checkpoints
        such runs (`mg.core.models.recompute`)."""
        hidden, context = carried
        for layer in layers:
            if isinstance(layer, RetroDecoderLayer):
                hidden, context = layer(hidden, rotary, attention_mask, context, context_mask)
            else:
                hidden = layer(hidden, rotary, attention_mask)
        return hidden, context


class RetroModel(GPTModel):
    """GPTModel with a RetroDecoderBlock; the neighbours share its embedding."""

    decoder_class = RetroDecoderBlock

    def __init__(self, config: RetroConfig) -> None:
        if not isinstance(config, RetroConfig):
            raise ConfigError("RetroModel needs a RetroConfig")
        super().__init__(config)
        self.register_load_state_dict_pre_hook(_retrofit_gpt_state_dict)

    def init_units(self) -> list[InitUnit]:
        """GPTModel's, less the decoder's final norm (there is none)."""
        return [u for u in super().init_units() if u.module is not None]

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        context_input_ids: Tensor | None = None,
        context_position_ids: Tensor | None = None,
        context_mask: Tensor | None = None,
        labels: Tensor | None = None,
    ) -> Tensor:
        """input_ids [b, s]; context_input_ids [b·l·k, r]: chunk i of row b's neighbour j
        at row (b·l + i)·k + j, Megatron's order (a [b, l, k, r] sample batch flattened);
        context_position_ids default to 0..r-1. Returns logits [b, s, vocab], or with
        labels the per-token cross-entropy [b, s] (as GPTModel)."""
        b, s = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(s, device=input_ids.device).expand(b, s)
        if context_input_ids is None:
            raise ValueError("RetroModel needs the neighbours' token ids (context_input_ids)")
        context_input_ids = context_input_ids.reshape(-1, context_input_ids.shape[-1])
        if context_position_ids is None:
            rows, r = context_input_ids.shape
            context_position_ids = torch.arange(r, device=input_ids.device).expand(rows, r)
        context = self.embedding(context_input_ids, context_position_ids)
        hidden = self.embedding(input_ids, position_ids)
        rotary = self.rotary_pos_emb(position_ids) if self.rotary_pos_emb is not None else None
        hidden = self.decoder(hidden, rotary, attention_mask, context, context_mask)
        return self.output_and_loss(hidden, labels)


def _retrofit_gpt_state_dict(module: RetroModel, state_dict: dict, prefix: str, *_: object) -> None:
    """Retro-fitting: a GPTModel's state dict (no cross-attention weights, a final norm)
    loads into a RetroModel; its GPT weights are taken, the Retro weights keep their
    initialisation and the GPT's final norm is dropped (Retro's decoder has none). A
    Retro state dict is left alone, so a missing Retro weight is still an error."""
    if any(".cross_attention." in key for key in state_dict):
        return
    if f"{prefix}decoder.final_layernorm.weight" not in state_dict:
        return
    for key in [k for k in state_dict if k.startswith(f"{prefix}decoder.final_layernorm.")]:
        del state_dict[key]
    for name, value in module.state_dict().items():
        if ".cross_attention." in name or ".pre_cross_attn_layernorm." in name:
            state_dict[prefix + name] = value
