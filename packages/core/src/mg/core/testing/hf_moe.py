"""Tiny random-init Hugging Face MoE models (Mixtral, Qwen3-MoE, Qwen2-MoE) for tests.

Each builder takes the dense shape (vocabulary, hidden size, layers, heads...)
as keyword arguments and adds its family's MoE pieces: 4 routed experts, top-2;
Qwen3-MoE with a dense first layer, Qwen2-MoE with a gated shared expert.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn


def mixtral(**shape: Any) -> nn.Module:
    # lazy: transformers is a test-only dependency
    import transformers

    config = transformers.MixtralConfig(
        **shape, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0
    )
    return transformers.MixtralForCausalLM(config)


def qwen3_moe(**shape: Any) -> nn.Module:
    # lazy: transformers is a test-only dependency
    import transformers

    config = transformers.Qwen3MoeConfig(
        **shape,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        norm_topk_prob=True,
        mlp_only_layers=[0],  # a dense first layer
    )
    return transformers.Qwen3MoeForCausalLM(config)


def qwen2_moe(**shape: Any) -> nn.Module:
    # lazy: transformers is a test-only dependency
    import transformers

    config = transformers.Qwen2MoeConfig(
        **shape,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,  # a gated shared expert beside the routed ones
        norm_topk_prob=False,
        tie_word_embeddings=False,
    )
    return transformers.Qwen2MoeForCausalLM(config)


HF_MOE_MODELS: dict[str, Callable[..., nn.Module]] = {
    "mixtral": mixtral,
    "qwen3_moe": qwen3_moe,
    "qwen2_moe": qwen2_moe,
}
"""Family name → builder."""
