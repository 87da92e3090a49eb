"""Multi-latent attention in the arithmetic planners: DeepSeek-V3's 671B, MLA's parameters
equal to the built module's, and Megatron's MLA FLOPs formula."""

from __future__ import annotations

import pytest
import torch

from mg.core.models import GPTModel, TransformerConfig
from mg.core.models.flops import mla_parameters, num_floating_point_operations, num_parameters
from mg.core.models.memory import layer_parameters

DEEPSEEK_V3 = dict(
    num_layers=61,
    hidden_size=7168,
    num_attention_heads=128,
    vocab_size=129280,
    ffn_hidden_size=18432,
    seq_length=4096,
    position_embedding_type="rope",
    normalization="RMSNorm",
    activation="swiglu",
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
    qk_layernorm=True,
    multi_latent_attention=True,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_head_dim=128,
    qk_pos_emb_head_dim=64,
    v_head_dim=128,
    rotary_scaling_factor=40.0,
    rope_type="yarn",
    mscale=1.0,
    mscale_all_dim=1.0,
    num_moe_experts=256,
    moe_ffn_hidden_size=2048,
    moe_shared_expert_intermediate_size=2048,
    moe_layer_freq=[0] * 3 + [1] * 58,
    moe_router_topk=8,
    moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True,
    moe_router_num_groups=8,
    moe_router_group_topk=4,
    moe_router_topk_scaling_factor=2.5,
)


def test_deepseek_v3_is_671b_with_37b_active() -> None:
    config = TransformerConfig(**DEEPSEEK_V3)
    assert num_parameters(config) == pytest.approx(671e9, rel=0.01)  # 671.03 B
    assert num_parameters(config, active=True) == pytest.approx(37e9, rel=0.03)  # 37.55 B


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_mla_parameters_are_the_modules(q_lora_rank) -> None:
    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        vocab_size=128,
        position_embedding_type="rope",
        normalization="RMSNorm",
        activation="swiglu",
        add_bias_linear=False,
        qk_layernorm=True,
        multi_latent_attention=True,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=16,
        qk_head_dim=8,
        qk_pos_emb_head_dim=4,
        v_head_dim=6,
    )
    with torch.device("meta"):
        model = GPTModel(config)
    layer = model.decoder.layers[0]
    assert mla_parameters(config) == sum(p.numel() for p in layer.self_attention.parameters())
    assert layer_parameters(config) == sum(p.numel() for p in layer.parameters())
    assert num_parameters(config) == sum(p.numel() for p in model.parameters())
    # tp 2: the per-head projections halve, the latents stay whole
    whole = 64 * (q_lora_rank or 0) + (q_lora_rank or 0) + 64 * (16 + 4) + 16
    assert mla_parameters(config, tp=2) == (mla_parameters(config) - whole) // 2 + whole


def test_mla_flops_are_megatrons_formula() -> None:
    """Megatron's training.py (core_v0.19.0), MLA branch, written out for one shape."""
    c = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        vocab_size=128,
        ffn_hidden_size=96,
        seq_length=32,
        position_embedding_type="rope",
        normalization="RMSNorm",
        activation="swiglu",
        add_bias_linear=False,
        multi_latent_attention=True,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_head_dim=8,
        qk_pos_emb_head_dim=4,
        v_head_dim=6,
    )
    b, s, h, heads, layers = 3, 32, 64, 4, 2
    q_term = 24 * (h + heads * 12 + 1)
    linear = 6 * (q_term + 16 * (h + heads * (8 + 6) + 1) + h * 4 + heads * 6 * h)
    core = 6 * (heads * 12 / 2 + heads * 6 / 2)
    mlp = 6 * 2 * 1.5 * h * 96  # 12·h·F·γ per token
    expected = b * s * layers * (linear + core * s + mlp) + 6 * b * s * h * 128
    assert num_floating_point_operations(c, b) == pytest.approx(expected, rel=1e-12)
