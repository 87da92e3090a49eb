"""MoE parameter counts (total and active), FLOPs with top-k and per-rank memory with EP."""

from __future__ import annotations

import dataclasses

import pytest

from mg.core.models import TransformerConfig
from mg.core.models.flops import num_floating_point_operations, num_parameters
from mg.core.models.gpt import GPTModel
from mg.core.models.memory import estimate_memory, stage_parameters

MIXTRAL_8X7B = TransformerConfig(
    num_layers=32,
    hidden_size=4096,
    num_attention_heads=32,
    num_query_groups=8,
    ffn_hidden_size=14336,
    vocab_size=32000,
    activation="swiglu",
    normalization="RMSNorm",
    position_embedding_type="rope",
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
    num_moe_experts=8,
    moe_router_topk=2,
    seq_length=4096,
)
TINY = dict(
    num_layers=3,
    hidden_size=16,
    num_attention_heads=4,
    vocab_size=64,
    ffn_hidden_size=32,
    activation="swiglu",
    add_bias_linear=False,
    num_moe_experts=4,
    moe_ffn_hidden_size=8,
)


def test_mixtral_8x7b_total_and_active_parameters():
    # Mistral AI's figures: 46.7B parameters, 12.9B used per token
    assert num_parameters(MIXTRAL_8X7B) == pytest.approx(46.70e9, rel=1e-3)
    assert num_parameters(MIXTRAL_8X7B, active=True) == pytest.approx(12.88e9, rel=1e-3)


@pytest.mark.parametrize(
    "fields",
    [
        {},
        dict(add_bias_linear=True, moe_shared_expert_intermediate_size=12),
        dict(moe_shared_expert_intermediate_size=12, moe_shared_expert_gate=True),
        dict(
            moe_layer_freq=[0, 1, 1],
            moe_grouped_gemm=True,
            untie_embeddings_and_output_weights=True,
        ),
    ],
)
def test_counts_equal_the_built_model(fields):
    config = TransformerConfig(**{**TINY, **fields})
    model = GPTModel(config)
    assert num_parameters(config) == sum(p.numel() for p in model.parameters())
    # active: every expert but k of the 4 left out in each MoE layer
    layer = next(m for m in model.modules() if hasattr(m, "router"))
    per_expert = sum(p.numel() for p in layer.experts.parameters()) // 4
    moe_layers = sum(config.moe_layer_pattern)
    expected = num_parameters(config) - moe_layers * (4 - 2) * per_expert
    assert num_parameters(config, active=True) == expected


def test_flops_count_topk_experts_like_a_dense_mlp_that_wide():
    config = TransformerConfig(**TINY, moe_shared_expert_intermediate_size=12)
    as_dense = dataclasses.replace(
        config,
        num_moe_experts=None,
        moe_ffn_hidden_size=None,
        moe_shared_expert_intermediate_size=None,
        ffn_hidden_size=2 * 8 + 12,
    )
    assert num_floating_point_operations(config, 8) == num_floating_point_operations(as_dense, 8)
    first_dense = dataclasses.replace(config, moe_layer_freq=[0, 1, 1])
    dense_layer = dataclasses.replace(
        config,
        num_moe_experts=None,
        moe_ffn_hidden_size=None,
        moe_shared_expert_intermediate_size=None,
    )
    expected = (
        2 * num_floating_point_operations(config, 8) + num_floating_point_operations(dense_layer, 8)
    ) / 3
    # the logits term is the same in all three, so the layer terms average
    assert num_floating_point_operations(first_dense, 8) == pytest.approx(expected)


def test_expert_parallel_ranks_hold_their_share_of_the_experts():
    config = TransformerConfig(**TINY)
    model = GPTModel(config)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    whole = stage_parameters(config)[0]
    assert whole == num_parameters(config)
    assert stage_parameters(config, ep=2)[0] == whole - experts // 2
    assert stage_parameters(config, ep=4)[0] == whole - 3 * experts // 4


def test_mixtral_plan_distributed_optimizer_shards_experts_over_expert_dp():
    """Megatron's examples/mixtral layout: PP 4, EP 8, DP 16 (64 ranks), bf16, dist-opt."""
    plan = dict(
        micro_batch_size=1,
        global_batch_size=256,
        pp=4,
        dp=16,
        param_dtype="bf16",
        activation_dtype="bf16",
        distributed_optimizer=True,
    )
    with_ep = estimate_memory(MIXTRAL_8X7B, ep=8, **plan)
    without = estimate_memory(MIXTRAL_8X7B, **plan)
    expert = 3 * 4096 * 14336  # one SwiGLU expert
    stage = with_ep.stages[1]  # 8 layers, no embeddings
    assert without.stages[1].parameters - stage.parameters == 8 * 7 * expert
    local_experts = 8 * expert  # 8 layers x 1 local expert
    dense = stage.parameters - local_experts
    # fp32 main params + Adam moments: 12 bytes, sharded over DP 16 / expert-DP 16 / 8 = 2
    assert stage.optimizer_state == pytest.approx(dense * 12 / 16 + local_experts * 12 / 2)
    assert with_ep.total_parameters == without.total_parameters
