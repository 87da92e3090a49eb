"""The `TransformerConfig` fields every Hugging Face decoder's config.json gives the same way.

Llama-style configs (Llama, Mistral, Qwen), Gemma 3 and gpt-oss name their shape alike;
each family's mapping adds what is its own (norms, activations, windows, experts) to
these. A module of its own because `hf_mapping` imports the family mappings.
"""

from __future__ import annotations

from typing import Any


def decoder_shape(
    c: dict[str, Any], *, eps: float, num_layers: int | None = None
) -> dict[str, Any]:
    """Layers, widths, heads (grouped-query), vocabulary, positions (RoPE) and RMSNorm's
    epsilon (`rms_norm_eps`, else `eps`) of the HF config `c`."""
    heads = c["num_attention_heads"]
    return dict(
        num_layers=c["num_hidden_layers"] if num_layers is None else num_layers,
        hidden_size=c["hidden_size"],
        num_attention_heads=heads,
        num_query_groups=c.get("num_key_value_heads") or heads,
        kv_channels=c.get("head_dim") or c["hidden_size"] // heads,
        ffn_hidden_size=c["intermediate_size"],
        vocab_size=c["vocab_size"],
        seq_length=c["max_position_embeddings"],
        max_position_embeddings=c["max_position_embeddings"],
        position_embedding_type="rope",
        normalization="RMSNorm",
        layernorm_epsilon=c.get("rms_norm_eps", eps),
    )
