"""Named model shapes: published architectures and tiny ones for tests.

Each factory returns a `TransformerConfig`; keyword overrides replace fields
before validation (`llama3_8b(num_layers=2)` is a valid two-layer Llama 3).
Vocabulary sizes are the published (HF) ones; GPT-2's is padded to 50304 as
Megatron-LM pads it (multiple of 128).
"""

from __future__ import annotations

from typing import Any

from mg.core.models.config import RopeScaling, TransformerConfig


def _make(defaults: dict[str, Any], overrides: dict[str, Any]) -> TransformerConfig:
    return TransformerConfig(**{**defaults, **overrides})


_LLAMA_COMMON: dict[str, Any] = dict(
    position_embedding_type="rope",
    normalization="RMSNorm",
    layernorm_epsilon=1e-5,
    activation="swiglu",
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
    attention_dropout=0.0,
    hidden_dropout=0.0,
)


def gpt2_124m(**overrides: Any) -> TransformerConfig:
    """GPT-2 small: 12 layers, 768 hidden, 12 heads, 1024 positions, tied embeddings."""
    return _make(
        dict(
            num_layers=12,
            hidden_size=768,
            num_attention_heads=12,
            vocab_size=50304,
            seq_length=1024,
            max_position_embeddings=1024,
            position_embedding_type="learned_absolute",
            normalization="LayerNorm",
            layernorm_epsilon=1e-5,
            activation="gelu_tanh",
            add_bias_linear=True,
        ),
        overrides,
    )


def llama2_7b(**overrides: Any) -> TransformerConfig:
    """Llama-2-7B: MHA, 4096 context."""
    return _make(
        dict(
            _LLAMA_COMMON,
            num_layers=32,
            hidden_size=4096,
            num_attention_heads=32,
            ffn_hidden_size=11008,
            vocab_size=32000,
            seq_length=4096,
            max_position_embeddings=4096,
            rotary_base=10000.0,
        ),
        overrides,
    )


def llama3_8b(**overrides: Any) -> TransformerConfig:
    """Llama-3-8B: GQA with 8 KV heads, RoPE base 500000, 128256-token vocabulary."""
    return _make(
        dict(
            _LLAMA_COMMON,
            num_layers=32,
            hidden_size=4096,
            num_attention_heads=32,
            num_query_groups=8,
            ffn_hidden_size=14336,
            vocab_size=128256,
            seq_length=8192,
            max_position_embeddings=8192,
            rotary_base=500000.0,
        ),
        overrides,
    )


def llama31_8b(**overrides: Any) -> TransformerConfig:
    """Llama-3.1-8B: Llama 3 plus "llama3" RoPE scaling to 128K positions."""
    defaults = dict(
        max_position_embeddings=131072,
        rope_scaling=RopeScaling(
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    )
    return llama3_8b(**{**defaults, **overrides})


def mistral_7b(**overrides: Any) -> TransformerConfig:
    """Mistral-7B v0.1: Llama-like with GQA and a 4096-token sliding window."""
    return _make(
        dict(
            _LLAMA_COMMON,
            num_layers=32,
            hidden_size=4096,
            num_attention_heads=32,
            num_query_groups=8,
            ffn_hidden_size=14336,
            vocab_size=32000,
            seq_length=4096,
            max_position_embeddings=32768,
            rotary_base=10000.0,
            window_size=(4095, 0),
        ),
        overrides,
    )


# Tiny shapes: fast on a laptop CPU, but with every feature switched on.


def tiny_gpt2(**overrides: Any) -> TransformerConfig:
    return gpt2_124m(
        **{
            **dict(
                num_layers=2,
                hidden_size=64,
                num_attention_heads=4,
                vocab_size=128,
                seq_length=32,
                max_position_embeddings=32,
            ),
            **overrides,
        }
    )


def tiny_llama(**overrides: Any) -> TransformerConfig:
    """Two layers, GQA (4 heads, 2 groups), SwiGLU, RMSNorm, RoPE, untied."""
    return llama3_8b(
        **{
            **dict(
                num_layers=2,
                hidden_size=64,
                num_attention_heads=4,
                num_query_groups=2,
                ffn_hidden_size=96,
                vocab_size=128,
                seq_length=32,
                max_position_embeddings=64,
                rotary_base=10000.0,
            ),
            **overrides,
        }
    )


def tiny_mistral(**overrides: Any) -> TransformerConfig:
    """`tiny_llama` with an 8-token sliding window (shorter than seq_length)."""
    return tiny_llama(**{**dict(window_size=(7, 0)), **overrides})


_GEMMA3_COMMON: dict[str, Any] = dict(
    position_embedding_type="rope",
    normalization="RMSNorm",
    layernorm_epsilon=1e-6,
    layernorm_zero_centered_gamma=True,
    sandwich_norms=True,
    qk_layernorm=True,
    activation="geglu_tanh",
    add_bias_linear=False,
    scale_embeddings_by_sqrt_hidden=True,
    kv_channels=256,
    softmax_scale=256**-0.5,  # query_pre_attn_scalar 256
    window_attn_skip_freq=6,  # five sliding-window layers, then a global one
    rotary_base=1_000_000.0,
    rotary_base_local=10_000.0,
    attention_dropout=0.0,
    hidden_dropout=0.0,
)


def gemma3_1b(**overrides: Any) -> TransformerConfig:
    """Gemma-3-1B (text): 26 layers, 1152 hidden, 4 heads of 256, one KV head, a 512-token
    window on five of every six layers, tied embeddings, 32K context."""
    return _make(
        dict(
            _GEMMA3_COMMON,
            num_layers=26,
            hidden_size=1152,
            num_attention_heads=4,
            num_query_groups=1,
            ffn_hidden_size=6912,
            vocab_size=262144,
            seq_length=32768,
            max_position_embeddings=32768,
            window_size=(511, 0),
        ),
        overrides,
    )


def tiny_gemma3(**overrides: Any) -> TransformerConfig:
    """Gemma 3's layer at test size: 4 layers (sliding, global, sliding, global), an
    8-token window shorter than seq_length."""
    return _make(
        dict(
            _GEMMA3_COMMON,
            num_layers=4,
            hidden_size=64,
            num_attention_heads=4,
            num_query_groups=2,
            kv_channels=16,
            softmax_scale=16**-0.5,
            ffn_hidden_size=96,
            vocab_size=128,
            seq_length=32,
            max_position_embeddings=64,
            window_size=(7, 0),
            window_attn_skip_freq=2,
        ),
        overrides,
    )


PRESETS = {
    "gpt2-124m": gpt2_124m,
    "llama2-7b": llama2_7b,
    "llama3-8b": llama3_8b,
    "llama3.1-8b": llama31_8b,
    "mistral-7b": mistral_7b,
    "tiny-gpt2": tiny_gpt2,
    "tiny-llama": tiny_llama,
    "tiny-mistral": tiny_mistral,
    "gemma3-1b": gemma3_1b,
    "tiny-gemma3": tiny_gemma3,
}
