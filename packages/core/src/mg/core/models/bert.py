"""BERT: a bidirectional encoder with a masked-LM head and a binary (sentence-order) head.

    embedding (words + positions + token types) → encoder → lm_head → output_layer
                                                        └→ pooler([CLS]) → binary_head

Names are Megatron-Core's BertModel names (`embedding.tokentype_embeddings`,
`encoder.layers.{i}...`, `lm_head.dense`, `lm_head.layer_norm`,
`output_layer.bias` with the weight tied to `embedding.word_embeddings`,
`pooler.dense`, `binary_head`), so a state dict converts to Megatron's by
layout only. Megatron-Core's layers are pre-LN (the same `TransformerLayer` as
GPT, built non-causal). `transformer_layer_order="post_ln"` gives the original
BERT arrangement that Hugging Face's BertModel uses (norm after each residual
add, a norm on the embeddings, no final norm); it exists so HF BERT weights
(e.g. MiniLM) load with identical outputs — see `bert_state_dict_from_hf`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mg.core.models.config import TransformerConfig
from mg.core.models.gpt import MLP, SelfAttention, TransformerBlock, build_norm
from mg.core.models.output_head import OutputHead
from mg.core.models.te_spec import init_linear


class BertEmbedding(nn.Module):
    """Words + learned positions + token types (Megatron's LanguageModelEmbedding
    with num_tokentypes); post-LN adds HF's norm on the sum (`layernorm`)."""

    def __init__(self, config: TransformerConfig, num_tokentypes: int) -> None:
        super().__init__()
        h = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, h)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, h)
        self.tokentype_embeddings = nn.Embedding(num_tokentypes, h) if num_tokentypes else None
        self.layernorm = build_norm(config) if config.transformer_layer_order == "post_ln" else None
        self.embedding_dropout = nn.Dropout(config.hidden_dropout)

    def init_weights(self, std: float) -> None:
        for emb in (self.word_embeddings, self.position_embeddings, self.tokentype_embeddings):
            if emb is not None:
                nn.init.normal_(emb.weight, mean=0.0, std=std)
        if self.layernorm is not None:
            self.layernorm.reset_parameters()

    def forward(self, input_ids: Tensor, position_ids: Tensor, tokentype_ids: Tensor | None):
        hidden = self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
        if self.tokentype_embeddings is not None:
            if tokentype_ids is None:
                tokentype_ids = torch.zeros_like(input_ids)
            hidden = hidden + self.tokentype_embeddings(tokentype_ids)
        if self.layernorm is not None:
            hidden = self.layernorm(hidden)
        return self.embedding_dropout(hidden)


class PostLNTransformerLayer(nn.Module):
    """The original BERT layer: x = LN(x + attn(x)); x = LN(x + mlp(x))."""

    def __init__(self, config: TransformerConfig, layer_number: int) -> None:
        super().__init__()
        self.layer_number = layer_number
        self.self_attention = SelfAttention(config, layer_number, causal=False)
        self.post_attention_layernorm = build_norm(config)
        self.mlp = MLP(config)
        self.post_mlp_layernorm = build_norm(config)
        self.hidden_dropout = nn.Dropout(config.hidden_dropout)

    def init_weights(self, std: float, output_std: float) -> None:
        self.post_attention_layernorm.reset_parameters()
        self.post_mlp_layernorm.reset_parameters()
        self.self_attention.init_weights(std, output_std)
        self.mlp.init_weights(std, output_std)

    def forward(
        self,
        hidden: Tensor,
        rotary: tuple[Tensor, Tensor] | None = None,
        attention_mask: Tensor | None = None,
    ) -> Tensor:
        attention = self.self_attention(hidden, rotary, attention_mask)
        hidden = self.post_attention_layernorm(hidden + self.hidden_dropout(attention))
        return self.post_mlp_layernorm(hidden + self.hidden_dropout(self.mlp(hidden)))


class PostLNTransformerBlock(nn.Module):
    """Post-LN layer stack; the last layer already ends in a norm, so no final norm."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            PostLNTransformerLayer(config, layer_number=i + 1) for i in range(config.num_layers)
        )

    def forward(
        self,
        hidden: Tensor,
        rotary: tuple[Tensor, Tensor] | None = None,
        attention_mask: Tensor | None = None,
    ) -> Tensor:
        for layer in self.layers:
            hidden = layer(hidden, rotary, attention_mask)
        return hidden


class BertLMHead(nn.Module):
    """dense → GELU → LayerNorm, before the (tied) output projection."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)

    def forward(self, hidden: Tensor) -> Tensor:
        return self.layer_norm(F.gelu(self.dense(hidden)))


class Pooler(nn.Module):
    """tanh(dense(hidden of the first token)): the [CLS] summary for the binary head."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden: Tensor) -> Tensor:
        return torch.tanh(self.dense(hidden[:, 0]))


class TiedOutputLayer(nn.Module):
    """Megatron's output_layer with tied embeddings: only its bias is a parameter."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(vocab_size))


def padding_attention_mask(attention_mask: Tensor | None) -> Tensor | None:
    """[b, s] with 1 = real token (the dataset's padding mask) → bool [b, 1, 1, s],
    True = may not attend (Megatron's convention).

    Only keys are masked. Megatron's extended mask also masks padded *queries*,
    which leaves their rows fully masked; SDPA would give NaN there, and those
    outputs are never used (the loss mask is 0 on padding), so we leave them be.
    """
    if attention_mask is None:
        return None
    return (attention_mask < 0.5)[:, None, None, :]


class BertModel(nn.Module):
    """Masked LM + binary head. forward → (per-token LM loss or logits, binary logits)."""

    def __init__(
        self, config: TransformerConfig, add_binary_head: bool = True, num_tokentypes: int = 2
    ) -> None:
        super().__init__()
        config.validate()
        if config.position_embedding_type != "learned_absolute":
            raise ValueError(
                "BertModel supports position_embedding_type='learned_absolute' only, got "
                f"{config.position_embedding_type!r}"
            )
        self.config = config
        self.output_head = OutputHead()  # logits and loss from the output layer (output_head)
        self.add_binary_head = add_binary_head
        self.embedding = BertEmbedding(config, num_tokentypes)
        if config.transformer_layer_order == "post_ln":
            self.encoder: nn.Module = PostLNTransformerBlock(config)
        else:
            self.encoder = TransformerBlock(config, causal=False)
        self.lm_head = BertLMHead(config)
        self.output_layer: nn.Module = (
            nn.Linear(config.hidden_size, config.vocab_size)
            if config.untie_embeddings_and_output_weights
            else TiedOutputLayer(config.vocab_size)
        )
        self.pooler = Pooler(config) if add_binary_head else None
        self.binary_head = nn.Linear(config.hidden_size, 2) if add_binary_head else None
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Megatron's init (as GPTModel's), heads N(0, σ), output bias 0."""
        std = self.config.init_method_std
        output_std = std / math.sqrt(2.0 * self.config.num_layers)
        self.embedding.init_weights(std)
        for layer in self.encoder.layers:
            layer.init_weights(std, output_std)
        if hasattr(self.encoder, "final_layernorm"):
            self.encoder.final_layernorm.reset_parameters()
        init_linear(self.lm_head.dense, std)
        self.lm_head.layer_norm.reset_parameters()
        if isinstance(self.output_layer, nn.Linear):
            init_linear(self.output_layer, std)
        else:
            nn.init.zeros_(self.output_layer.bias)
        for linear in (self.pooler and self.pooler.dense, self.binary_head):
            if linear is not None:
                init_linear(linear, std)

    def output_weight(self) -> Tensor:
        if isinstance(self.output_layer, nn.Linear):
            return self.output_layer.weight
        return self.embedding.word_embeddings.weight

    def output_bias(self) -> Tensor:
        return self.output_layer.bias

    def output_and_loss(self, hidden: Tensor, labels: Tensor | None) -> Tensor:
        """The LM head's output [b, s, h] → logits [b, s, vocab], or with labels the
        per-token fp32 cross-entropy [b, s], by `output_head` (tensor parallelism
        chooses its vocab-parallel one: mg.core.parallel.tensor_parallel)."""
        return self.output_head(self, hidden, labels)

    def binary_logits(self, hidden: Tensor) -> Tensor | None:
        """The sentence-order logits [b, 2] from the encoder output (None without the head)."""
        if self.binary_head is None:
            return None
        return self.binary_head(self.pooler(hidden))

    def encode(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        tokentype_ids: Tensor | None = None,
    ) -> Tensor:
        """The encoder's last hidden states [b, s, h] (what HF's BertModel returns)."""
        b, s = input_ids.shape
        position_ids = torch.arange(s, device=input_ids.device).expand(b, s)
        hidden = self.embedding(input_ids, position_ids, tokentype_ids)
        return self.encoder(hidden, None, padding_attention_mask(attention_mask))

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        tokentype_ids: Tensor | None = None,
        lm_labels: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """input_ids [b, s], attention_mask [b, s] (1 = real token), tokentype_ids [b, s].

        Returns (logits [b, s, vocab], or with lm_labels the per-token fp32
        cross-entropy [b, s] unreduced, as Megatron), and binary logits [b, 2]
        (None without the binary head). The trainer applies the loss mask.
        """
        hidden = self.encode(input_ids, attention_mask, tokentype_ids)
        return self.output_and_loss(self.lm_head(hidden), lm_labels), self.binary_logits(hidden)


def bert_from_state_dict(weights: dict[str, Tensor], config: TransformerConfig) -> BertModel:
    """A BertModel shaped as the weights say (binary head or not, number of token
    types) holding them, built on the meta device so the tensors are held once."""
    tokentypes = weights.get("embedding.tokentype_embeddings.weight")
    with torch.device("meta"):
        model = BertModel(
            config,
            add_binary_head="binary_head.weight" in weights,
            num_tokentypes=0 if tokentypes is None else tokentypes.shape[0],
        )
    model.load_state_dict(weights, strict=True, assign=True)
    return model


# --- Hugging Face BERT (post-LN) ------------------------------------------------


def bert_config_from_hf(hf_config: Any, **overrides: Any) -> TransformerConfig:
    """A post-LN TransformerConfig equal in shape to a transformers BertConfig."""
    c = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
    acts = {
        "gelu": "gelu",
        "gelu_new": "gelu_tanh",
        "gelu_pytorch_tanh": "gelu_tanh",
        "relu": "relu",
    }
    if c.get("hidden_act", "gelu") not in acts:
        raise ValueError(f"BERT hidden_act {c['hidden_act']!r} is not supported ({sorted(acts)})")
    if c.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(
            f"BERT position_embedding_type {c['position_embedding_type']!r} is not supported "
            "(only 'absolute')"
        )
    act = acts[c.get("hidden_act", "gelu")]
    fields = dict(
        num_layers=c["num_hidden_layers"],
        hidden_size=c["hidden_size"],
        num_attention_heads=c["num_attention_heads"],
        ffn_hidden_size=c["intermediate_size"],
        vocab_size=c["vocab_size"],
        seq_length=c["max_position_embeddings"],
        max_position_embeddings=c["max_position_embeddings"],
        layernorm_epsilon=c.get("layer_norm_eps", 1e-12),
        activation=act,
        transformer_layer_order="post_ln",
        attention_dropout=c.get("attention_probs_dropout_prob", 0.1),
        hidden_dropout=c.get("hidden_dropout_prob", 0.1),
        init_method_std=c.get("initializer_range", 0.02),
        untie_embeddings_and_output_weights=not c.get("tie_word_embeddings", True),
        extra={"hf_architecture": "bert", "type_vocab_size": c.get("type_vocab_size", 2)},
    )
    return TransformerConfig(**(fields | overrides))


def _fuse_qkv(q: Tensor, k: Tensor, v: Tensor, heads: int) -> Tensor:
    """HF's separate q, k, v → Megatron's per-head [q; k; v] blocks (MHA: one head per group)."""
    rest = q.shape[1:]
    parts = [t.reshape(heads, -1, *rest) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *rest).contiguous()


def bert_state_dict_from_hf(hf_state: dict[str, Tensor], config: TransformerConfig) -> dict:
    """Map a transformers BertModel / BertForPreTraining state dict onto a post-LN
    BertModel's names. Keys may carry the `bert.` prefix (BertForPreTraining) or
    not (BertModel). Heads missing from the source (MiniLM has no MLM head) are
    simply absent: load with `strict=False` and check the missing keys."""
    sd = {k.removeprefix("bert."): v for k, v in hf_state.items()}
    out: dict[str, Tensor] = {}

    def put(ours: str, theirs: str) -> None:
        if theirs in sd:
            out[ours] = sd[theirs]

    put("embedding.word_embeddings.weight", "embeddings.word_embeddings.weight")
    put("embedding.position_embeddings.weight", "embeddings.position_embeddings.weight")
    put("embedding.tokentype_embeddings.weight", "embeddings.token_type_embeddings.weight")
    put("embedding.layernorm.weight", "embeddings.LayerNorm.weight")
    put("embedding.layernorm.bias", "embeddings.LayerNorm.bias")
    heads = config.num_attention_heads
    for i in range(config.num_layers):
        h, m = f"encoder.layer.{i}.", f"encoder.layers.{i}."
        a = h + "attention.self."
        for kind in ("weight", "bias"):
            out[m + f"self_attention.linear_qkv.{kind}"] = _fuse_qkv(
                sd[a + f"query.{kind}"], sd[a + f"key.{kind}"], sd[a + f"value.{kind}"], heads
            )
            put(m + f"self_attention.linear_proj.{kind}", h + f"attention.output.dense.{kind}")
            put(m + f"post_attention_layernorm.{kind}", h + f"attention.output.LayerNorm.{kind}")
            put(m + f"mlp.linear_fc1.{kind}", h + f"intermediate.dense.{kind}")
            put(m + f"mlp.linear_fc2.{kind}", h + f"output.dense.{kind}")
            put(m + f"post_mlp_layernorm.{kind}", h + f"output.LayerNorm.{kind}")
            put(f"pooler.dense.{kind}", f"pooler.dense.{kind}")
            put(f"lm_head.dense.{kind}", f"cls.predictions.transform.dense.{kind}")
            put(f"binary_head.{kind}", f"cls.seq_relationship.{kind}")
        put("lm_head.layer_norm.weight", "cls.predictions.transform.LayerNorm.weight")
        put("lm_head.layer_norm.bias", "cls.predictions.transform.LayerNorm.bias")
    put("output_layer.bias", "cls.predictions.bias")
    return out
