"""Gemma 3 (text) config.json ↔ `TransformerConfig`: which Megatron fields Gemma's are.

Gemma 3's decoder is GPTModel with these settings (its weight table is
`hf_mapping.GEMMA3`, names only):

    sandwich norms               sandwich_norms (post_self_attn_layernorm, post_mlp_layernorm)
    RMSNorm x·(1 + w) in fp32    normalization RMSNorm + layernorm_zero_centered_gamma
    q_norm / k_norm              qk_layernorm
    GeGLU, gelu_pytorch_tanh     activation "geglu_tanh"
    embeddings × √hidden         scale_embeddings_by_sqrt_hidden
    query_pre_attn_scalar q      softmax_scale = q**-0.5
    sliding_window W             window_size (W - 1, 0)
    layer_types / pattern N      window_attn_skip_freq (N, or a 0/1 list, 1 = sliding)
    rope_local_base_freq         rotary_base_local (the sliding layers' RoPE)
    rope_theta + linear scaling  rotary_base + rotary_seq_len_interpolation_factor

Both spellings of the RoPE settings are read: transformers 5's `rope_parameters`
per layer type, and 4's `rope_theta` / `rope_local_base_freq` / `rope_scaling`.
Soft-capping: transformers' Gemma3Attention does not apply `attn_logit_softcapping`
(null in Gemma 3's own configs; the field is kept from Gemma 2), so the import leaves
it off too and the logits match; a model of ours that caps its attention logits is
refused on export, since Gemma3ForCausalLM would not. Capping the final logits is
refused by name.
"""

from __future__ import annotations

from typing import Any

from mg.core.models.config import RopeScaling, TransformerConfig
from mg.core.models.hf_config_fields import decoder_shape

GEMMA3_TYPE = "gemma3_text"
GEMMA3_CLASS = "Gemma3ForCausalLM"
_SLIDING, _FULL = "sliding_attention", "full_attention"


def _layer_types(c: dict[str, Any]) -> list[str]:
    layers = c["num_hidden_layers"]
    if c.get("layer_types"):
        return list(c["layer_types"])
    pattern = c.get("sliding_window_pattern") or c.get("_sliding_window_pattern") or 6
    return [_SLIDING if (i + 1) % pattern else _FULL for i in range(layers)]


def skip_freq_of(layer_types: list[str]) -> int | list[int] | None:
    """Megatron's window_attn_skip_freq for HF's layer_types: None when every layer
    slides, N when every N-th layer is global, else the 0/1 list (1 = sliding)."""
    sliding = [t == _SLIDING for t in layer_types]
    if all(sliding):
        return None
    for n in range(1, len(sliding) + 1):
        if sliding == [(i + 1) % n != 0 for i in range(len(sliding))]:
            return n
    return [int(s) for s in sliding]


def _rope_of(c: dict[str, Any]) -> dict[str, Any]:
    """The global and local RoPE fields from either spelling of a Gemma 3 config."""
    params = c.get("rope_parameters") or {}
    full = dict(params.get(_FULL) or {})
    local = dict(params.get(_SLIDING) or {})
    if not full:
        full = dict(c.get("rope_scaling") or {})
        full.setdefault("rope_theta", c.get("rope_theta", 1_000_000.0))
    local.setdefault("rope_theta", c.get("rope_local_base_freq", 10_000.0))
    fields: dict[str, Any] = dict(
        rotary_base=float(full["rope_theta"]), rotary_base_local=float(local["rope_theta"])
    )
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise ValueError(
            f"Gemma 3 rope_parameters.{_SLIDING}.rope_type {local.get('rope_type')!r} is not "
            "supported (the sliding layers' RoPE is unscaled: 'default')"
        )
    rope_type = full.get("rope_type", full.get("type", "default"))
    if rope_type == "linear":
        fields["rotary_seq_len_interpolation_factor"] = float(full["factor"])
    elif rope_type == "llama3":
        fields["rope_scaling"] = RopeScaling(
            factor=float(full["factor"]),
            low_freq_factor=float(full["low_freq_factor"]),
            high_freq_factor=float(full["high_freq_factor"]),
            original_max_position_embeddings=int(full["original_max_position_embeddings"]),
        )
    elif rope_type != "default":
        raise ValueError(
            f"Gemma 3 rope_parameters.{_FULL}.rope_type {rope_type!r} is not supported "
            "(only 'default', 'linear' and 'llama3')"
        )
    return fields


def gemma3_config_from_hf(c: dict[str, Any]) -> dict[str, Any]:
    """`TransformerConfig` fields of a Gemma3TextConfig dict; ValueError names what
    Megatron's decoder cannot run."""
    if c.get("final_logit_softcapping") is not None:
        raise ValueError(
            f"Gemma 3 final_logit_softcapping={c['final_logit_softcapping']}: capping the "
            "output logits is not supported yet (Gemma 3's own configs leave it null)"
        )
    if c.get("use_bidirectional_attention"):
        raise ValueError("Gemma 3 use_bidirectional_attention is not supported (a decoder only)")
    if c.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ValueError(
            f"Gemma 3 hidden_activation {c['hidden_activation']!r} is not supported "
            "(only 'gelu_pytorch_tanh')"
        )
    if c.get("attention_bias"):
        raise ValueError(
            "Gemma 3 attention_bias (biases on q/k/v/o but not the MLP) cannot be expressed "
            "with Megatron's add_bias_linear / add_qkv_bias"
        )
    window = c.get("sliding_window")
    layer_types = _layer_types(c)
    skip = skip_freq_of(layer_types) if window else None
    if not window and any(t == _SLIDING for t in layer_types):
        raise ValueError("Gemma 3 layer_types has sliding layers but sliding_window is null")
    rope = _rope_of(c)
    if not window:
        rope["rotary_base_local"] = None
    return dict(
        **decoder_shape(c, eps=1e-6),
        layernorm_zero_centered_gamma=True,
        sandwich_norms=True,
        qk_layernorm=True,
        activation="geglu_tanh",
        add_bias_linear=False,
        scale_embeddings_by_sqrt_hidden=True,
        softmax_scale=float(c.get("query_pre_attn_scalar", 256)) ** -0.5,
        window_size=(window - 1, 0) if window else None,
        window_attn_skip_freq=skip,
        untie_embeddings_and_output_weights=not c.get("tie_word_embeddings", True),
        init_method_std=c.get("initializer_range", 0.02),
        attention_dropout=c.get("attention_dropout", 0.0),
        hidden_dropout=0.0,
        **rope,
    )


def _query_pre_attn_scalar(scale: float) -> float | int:
    """Gemma's query_pre_attn_scalar of a softmax scale (an integer where it is one)."""
    scalar = scale**-2
    return round(scalar) if abs(scalar - round(scalar)) < 1e-6 * scalar else scalar


def gemma3_config_to_hf(c: TransformerConfig) -> dict[str, Any]:
    """The Gemma3TextConfig fields of `c`; ValueError if Gemma 3 cannot express it."""
    if not (
        c.position_embedding_type == "rope"
        and c.rotary_percent == 1.0
        and c.normalization == "RMSNorm"
        and c.layernorm_zero_centered_gamma
        and c.sandwich_norms
        and c.qk_layernorm
        and c.activation == "geglu_tanh"
        and not c.add_bias_linear
        and not c.add_qkv_bias
        and c.scale_embeddings_by_sqrt_hidden
        and c.num_moe_experts is None
        and c.attn_logit_softcapping is None
    ):
        raise ValueError(
            "this config is not a Gemma3ForCausalLM architecture (it needs RoPE, zero-centred "
            "RMSNorm sandwich norms, q/k norms, geglu_tanh, no biases, √hidden embedding "
            "scaling, and no attention logit soft-capping, which its attention ignores)"
        )
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": c.rotary_base}
    if c.rotary_seq_len_interpolation_factor is not None:
        full.update(rope_type="linear", factor=c.rotary_seq_len_interpolation_factor)
    elif c.rope_scaling is not None:
        full.update(rope_type="llama3", **vars(c.rope_scaling))
    scaled = full["rope_type"] != "default"
    if (
        c.rotary_base_local is None
        and scaled
        and any(map(c.is_window_layer, range(1, 1 + c.num_layers)))
    ):
        raise ValueError(
            "Gemma 3's sliding layers take an unscaled RoPE: set rotary_base_local "
            "(--rotary-base-local) for a model with RoPE scaling"
        )
    local_base = c.rotary_base_local if c.rotary_base_local is not None else c.rotary_base
    layer_types = [_SLIDING if c.is_window_layer(i + 1) else _FULL for i in range(c.num_layers)]
    out = dict(
        num_hidden_layers=c.num_layers,
        hidden_size=c.hidden_size,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_query_groups,
        head_dim=c.kv_channels,
        intermediate_size=c.ffn_hidden_size,
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.layernorm_epsilon,
        hidden_activation="gelu_pytorch_tanh",
        attention_bias=False,
        attention_dropout=c.attention_dropout,
        query_pre_attn_scalar=_query_pre_attn_scalar(c.attention_softmax_scale),
        sliding_window=c.window_size[0] + 1 if c.window_size is not None else None,
        layer_types=layer_types,
        rope_parameters={_FULL: full, _SLIDING: {"rope_type": "default", "rope_theta": local_base}},
        attn_logit_softcapping=None,
        final_logit_softcapping=None,
    )
    if isinstance(c.window_attn_skip_freq, int):
        out["sliding_window_pattern"] = c.window_attn_skip_freq
    return out
