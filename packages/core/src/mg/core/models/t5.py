"""T5: an encoder-decoder with Megatron-Core's T5Model layout.

    embedding(enc ids) → encoder (bidirectional layers, final norm) ─────────┐
    embedding(dec ids) → decoder layers: causal self-attn → cross-attn(enc) → MLP
                       → final norm → lm_head.output_layer (weight tied, own bias)

One embedding (words + learned absolute positions, Megatron's default for T5)
is shared by encoder, decoder and output. Names follow Megatron-Core's local
T5 spec: `encoder.layers.{i}` are GPT-style pre-LN layers built non-causal;
`decoder.layers.{i}` add `pre_cross_attn_layernorm` and
`cross_attention.{linear_q, linear_kv, linear_proj}`; `lm_head.output_layer.bias`.

Masks are the dataset's padding masks, [b, s] with 1 = real token
(`enc_mask`, `dec_mask` of a T5 sample), or boolean [b|1, 1, sq, sk] masks
with True = may not attend (Megatron's convention).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from mg.core.models.config import TransformerConfig
from mg.core.models.core_attention import build_core_attention
from mg.core.models.gpt import MLP, SelfAttention, TransformerBlock, build_norm
from mg.core.models.language_model import LanguageModelEmbedding
from mg.core.models.output_head import OutputHead
from mg.core.models.te_spec import init_linear


def attention_mask_from(mask: Tensor | None) -> Tensor | None:
    """A padding mask [b, sk] (1 = real) → bool [b, 1, 1, sk] (True = masked); a 4-D
    bool mask passes through with fully masked query rows opened up: those rows
    are padding whose output is never used, and SDPA would make them NaN."""
    if mask is None:
        return None
    if mask.dim() == 2:
        return (mask < 0.5)[:, None, None, :]
    return mask & ~mask.all(dim=-1, keepdim=True)


class CrossAttention(nn.Module):
    """Queries from the decoder, keys/values from the encoder output.

    linear_kv rows are grouped per head as [k(h); v(h)], Megatron's layout
    (its CrossAttention views [sk, b, heads, 2·d] and splits the last dim).
    """

    def __init__(self, config: TransformerConfig, layer_number: int) -> None:
        super().__init__()
        if config.num_query_groups != config.num_attention_heads:
            raise ValueError("T5 cross attention needs num_query_groups == num_attention_heads")
        self.num_heads = config.num_attention_heads
        self.head_dim = config.kv_channels
        size = config.query_projection_size
        bias = config.add_bias_linear
        self.linear_q = nn.Linear(config.hidden_size, size, bias=bias)
        self.linear_kv = nn.Linear(config.hidden_size, 2 * size, bias=bias)
        self.core_attention = build_core_attention(config, layer_number, causal=False)
        self.linear_proj = nn.Linear(size, config.hidden_size, bias=bias)

    def init_weights(self, std: float, output_std: float) -> None:
        init_linear(self.linear_q, std)
        init_linear(self.linear_kv, std)
        init_linear(self.linear_proj, output_std)

    def forward(self, hidden: Tensor, context: Tensor, attention_mask: Tensor | None) -> Tensor:
        b, sq, _ = hidden.shape
        sk = context.shape[1]
        query = self.linear_q(hidden).view(b, sq, self.num_heads, self.head_dim)
        kv = self.linear_kv(context).view(b, sk, self.num_heads, 2 * self.head_dim)
        key, value = kv.split(self.head_dim, dim=-1)
        context = self.core_attention(
            query, key.contiguous(), value.contiguous(), attention_mask=attention_mask
        )
        return self.linear_proj(context)


class T5DecoderLayer(nn.Module):
    """Pre-LN: causal self-attention, cross-attention to the encoder, MLP."""

    def __init__(self, config: TransformerConfig, layer_number: int) -> None:
        super().__init__()
        self.layer_number = layer_number
        self.input_layernorm = build_norm(config)
        self.self_attention = SelfAttention(config, layer_number)
        self.pre_cross_attn_layernorm = build_norm(config)
        self.cross_attention = CrossAttention(config, layer_number)
        self.pre_mlp_layernorm = build_norm(config)
        self.mlp = MLP(config)
        self.hidden_dropout = nn.Dropout(config.hidden_dropout)

    def init_weights(self, std: float, output_std: float) -> None:
        for norm in (self.input_layernorm, self.pre_cross_attn_layernorm, self.pre_mlp_layernorm):
            norm.reset_parameters()
        self.self_attention.init_weights(std, output_std)
        self.cross_attention.init_weights(std, output_std)
        self.mlp.init_weights(std, output_std)

    def forward(
        self,
        hidden: Tensor,
        context: Tensor,
        attention_mask: Tensor | None = None,
        context_mask: Tensor | None = None,
    ) -> Tensor:
        attn = self.self_attention(self.input_layernorm(hidden), None, attention_mask)
        hidden = hidden + self.hidden_dropout(attn)
        cross = self.cross_attention(self.pre_cross_attn_layernorm(hidden), context, context_mask)
        hidden = hidden + self.hidden_dropout(cross)
        return hidden + self.hidden_dropout(self.mlp(self.pre_mlp_layernorm(hidden)))


class T5DecoderBlock(nn.Module):
    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            T5DecoderLayer(config, layer_number=i + 1) for i in range(config.num_layers)
        )
        self.final_layernorm = build_norm(config)

    def forward(self, hidden, context, attention_mask=None, context_mask=None) -> Tensor:
        for layer in self.layers:
            hidden = layer(hidden, context, attention_mask, context_mask)
        return self.final_layernorm(hidden)


class T5LMHead(nn.Module):
    """Holds `output_layer`: a bias only when tied (Megatron's T5LMHead), else a Linear."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        if config.untie_embeddings_and_output_weights:
            self.output_layer: nn.Module = nn.Linear(
                config.hidden_size, config.vocab_size, bias=False
            )
        else:
            self.output_layer = nn.Module()
            self.output_layer.bias = nn.Parameter(torch.zeros(config.vocab_size))


class T5Model(nn.Module):
    """Encoder-decoder LM. `config.seq_length` is the encoder length
    (`--encoder-seq-length`), `config.decoder_seq_length` the decoder's; the
    number of layers applies to both stacks, as Megatron's `--num-layers`."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        config.validate()
        if config.position_embedding_type != "learned_absolute":
            raise ValueError(
                "T5Model supports position_embedding_type='learned_absolute' only "
                f"(Megatron's default), got {config.position_embedding_type!r}"
            )
        if config.transformer_layer_order != "pre_ln":
            raise ValueError("T5Model is pre-LN only (transformer_layer_order='pre_ln')")
        self.config = config
        self.output_head = OutputHead()  # logits and loss from the output layer (output_head)
        self.embedding = LanguageModelEmbedding(config)
        self.encoder = TransformerBlock(config, causal=False)
        self.decoder = T5DecoderBlock(config)
        self.lm_head = T5LMHead(config)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Megatron's init (see GPTModel.init_weights); output bias 0."""
        std = self.config.init_method_std
        output_std = std / math.sqrt(2.0 * self.config.num_layers)
        self.embedding.init_weights(std)
        for block in (self.encoder, self.decoder):
            for layer in block.layers:
                layer.init_weights(std, output_std)
            block.final_layernorm.reset_parameters()
        out = self.lm_head.output_layer
        if isinstance(out, nn.Linear):
            nn.init.normal_(out.weight, mean=0.0, std=std)
        else:
            nn.init.zeros_(out.bias)

    def output_weight(self) -> Tensor:
        out = self.lm_head.output_layer
        return out.weight if isinstance(out, nn.Linear) else self.embedding.word_embeddings.weight

    def output_bias(self) -> Tensor | None:
        return self.lm_head.output_layer.bias

    def output_and_loss(self, hidden: Tensor, labels: Tensor | None) -> Tensor:
        """The decoder output [b, s, h] → logits [b, s, vocab], or with labels the per-token
        fp32 cross-entropy [b, s], by `output_head` (tensor parallelism chooses its
        vocab-parallel one: mg.core.parallel.tensor_parallel)."""
        return self.output_head(self, hidden, labels)

    def _embed(self, ids: Tensor) -> Tensor:
        b, s = ids.shape
        return self.embedding(ids, torch.arange(s, device=ids.device).expand(b, s))

    def encode(self, encoder_input_ids: Tensor, encoder_attn_mask: Tensor | None = None) -> Tensor:
        """Encoder output [b, s_enc, h]."""
        hidden = self._embed(encoder_input_ids)
        return self.encoder(hidden, None, attention_mask_from(encoder_attn_mask))

    def forward(
        self,
        encoder_input_ids: Tensor,
        decoder_input_ids: Tensor,
        encoder_attn_mask: Tensor | None = None,
        decoder_attn_mask: Tensor | None = None,
        encoder_decoder_attn_mask: Tensor | None = None,
        lm_labels: Tensor | None = None,
    ) -> Tensor:
        """Logits [b, s_dec, vocab], or with lm_labels [b, s_dec] the per-token fp32
        cross-entropy [b, s_dec] (unreduced; the trainer applies the loss mask).

        encoder_decoder_attn_mask masks encoder positions (keys) for the
        decoder; [b, s_enc] padding form, so usually the encoder's own mask.
        """
        context = self.encode(encoder_input_ids, encoder_attn_mask)
        hidden = self.decoder(
            self._embed(decoder_input_ids),
            context,
            attention_mask_from(decoder_attn_mask),
            attention_mask_from(encoder_decoder_attn_mask),
        )
        return self.output_and_loss(hidden, lm_labels)
