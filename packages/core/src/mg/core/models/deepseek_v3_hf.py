"""DeepSeek-V3 config.json ↔ `TransformerConfig`: which Megatron fields DeepSeek's are.

DeepSeek-V3's decoder is GPTModel with multi-latent attention and DeepSeek's MoE (its
weight table is `hf_mapping.DEEPSEEK_V3`, names only):

    q_lora_rank, kv_lora_rank        q_lora_rank, kv_lora_rank (MLA, mg.core.models.mla)
    qk_nope_head_dim, qk_rope_head_dim, v_head_dim
                                     qk_head_dim, qk_pos_emb_head_dim, v_head_dim
    q_a_layernorm / kv_a_layernorm   qk_layernorm (norms on the latents)
    rope_interleave                  Megatron's MLA RoPE is the interleaved one: required
    rope_parameters yarn             rope_type "yarn": factor → rotary_scaling_factor, mscale,
                                     mscale_all_dim, original_max_position_embeddings,
                                     beta_fast, beta_slow, truncate
    sigmoid router + e_score_correction_bias
                                     moe_router_score_function "sigmoid" with
                                     moe_router_enable_expert_bias (router.expert_bias)
    n_group, topk_group              moe_router_num_groups, moe_router_group_topk
    routed_scaling_factor            moe_router_topk_scaling_factor
    norm_topk_prob                   Megatron renormalises sigmoid top-k weights: required
    n_shared_experts                 moe_shared_expert_intermediate_size = n · moe_intermediate
    first_k_dense_replace k          moe_layer_freq [0]·k + [1]·(L − k)

Megatron's group-limited routing scores a group by the sum of its top (topk / group_topk)
experts, transformers' by its top 2: the configs must agree (DeepSeek-V3's 8 / 4 does),
or the import names the fields. The released model's multi-token-prediction layers
(num_nextn_predict_layers, stored as model.layers.{num_hidden_layers + k}) are Megatron's
MTP block (mtp_num_layers); DeepseekV3ForCausalLM itself neither builds nor saves them.
"""

from __future__ import annotations

from typing import Any

from mg.core.models.config import TransformerConfig

DEEPSEEK_V3_TYPE = "deepseek_v3"
DEEPSEEK_V3_CLASS = "DeepseekV3ForCausalLM"


def _rope_fields(c: dict[str, Any]) -> dict[str, Any]:
    """RoPE fields of a DeepSeek-V3 config (transformers 5's rope_parameters, or 4's
    rope_theta + rope_scaling)."""
    params = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    base = float(params.get("rope_theta", c.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return dict(rotary_base=base, rope_type="rope")
    if kind != "yarn":
        raise ValueError(
            f"DeepSeek-V3 rope_parameters.rope_type {kind!r} is not supported "
            "(only 'default' and 'yarn')"
        )
    if params.get("attention_factor") is not None:
        raise ValueError("DeepSeek-V3 rope_parameters.attention_factor is not supported")
    original = int(params["original_max_position_embeddings"])
    factor = params.get("factor") or c["max_position_embeddings"] / original
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if not (mscale and mscale_all_dim):
        if mscale_all_dim:
            raise ValueError(
                "DeepSeek-V3 rope_parameters: mscale_all_dim without mscale is not supported"
            )
        mscale, mscale_all_dim = 1.0, 0.0  # transformers' attention factor 0.1·ln(s) + 1
    return dict(
        rotary_base=base,
        rope_type="yarn",
        rotary_scaling_factor=float(factor),
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=float(mscale),
        mscale_all_dim=float(mscale_all_dim),
        yarn_correction_range_round_to_int=bool(params.get("truncate", True)),
    )


def deepseek_v3_config_from_hf(c: dict[str, Any]) -> dict[str, Any]:
    """`TransformerConfig` fields of a DeepseekV3Config dict; ValueError names what
    Megatron's decoder cannot run."""
    if c.get("hidden_act", "silu") != "silu":
        raise ValueError(f"DeepSeek-V3 hidden_act {c['hidden_act']!r} is not supported")
    if c.get("attention_bias"):
        raise ValueError("DeepSeek-V3 attention_bias is not supported (Megatron's MLA has none)")
    if not c.get("rope_interleave", True):
        raise ValueError(
            "DeepSeek-V3 rope_interleave false is not supported (Megatron's MLA rotates the "
            "interleaved pairs)"
        )
    if not c.get("norm_topk_prob", True) and c["num_experts_per_tok"] > 1:
        raise ValueError(
            "DeepSeek-V3 norm_topk_prob false is not supported (Megatron renormalises the "
            "sigmoid top-k weights)"
        )
    topk, groups = c["num_experts_per_tok"], c.get("n_group") or 1
    group_topk = c.get("topk_group") or groups
    limited = groups > 1
    if limited and topk // group_topk != 2:
        raise ValueError(
            f"DeepSeek-V3 num_experts_per_tok {topk} / topk_group {group_topk} must be 2: "
            "transformers scores a group by its top 2 experts, Megatron by its top "
            "num_experts_per_tok / topk_group"
        )
    layers = c["num_hidden_layers"]
    dense = min(c.get("first_k_dense_replace", 0), layers)
    shared = c.get("n_shared_experts") or 0
    return dict(
        num_layers=layers,
        hidden_size=c["hidden_size"],
        num_attention_heads=c["num_attention_heads"],
        ffn_hidden_size=c["intermediate_size"],
        vocab_size=c["vocab_size"],
        seq_length=c["max_position_embeddings"],
        max_position_embeddings=c["max_position_embeddings"],
        position_embedding_type="rope",
        normalization="RMSNorm",
        layernorm_epsilon=c.get("rms_norm_eps", 1e-6),
        activation="swiglu",
        add_bias_linear=False,
        qk_layernorm=True,
        untie_embeddings_and_output_weights=not c.get("tie_word_embeddings", False),
        init_method_std=c.get("initializer_range", 0.02),
        attention_dropout=c.get("attention_dropout", 0.0),
        hidden_dropout=0.0,
        multi_latent_attention=True,
        q_lora_rank=c.get("q_lora_rank"),
        kv_lora_rank=c["kv_lora_rank"],
        qk_head_dim=c["qk_nope_head_dim"],
        qk_pos_emb_head_dim=c["qk_rope_head_dim"],
        v_head_dim=c["v_head_dim"],
        num_moe_experts=c["n_routed_experts"],
        moe_ffn_hidden_size=c["moe_intermediate_size"],
        moe_layer_freq=[0] * dense + [1] * (layers - dense),
        moe_router_topk=topk,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=float(c.get("routed_scaling_factor") or 1.0),
        moe_router_num_groups=groups if limited else None,
        moe_router_group_topk=group_topk if limited else None,
        moe_router_dtype="fp32",  # transformers' router computes in fp32
        moe_router_load_balancing_type="none",
        moe_shared_expert_intermediate_size=shared * c["moe_intermediate_size"] or None,
        mtp_num_layers=c.get("num_nextn_predict_layers") or None,
        **_rope_fields(c),
    )


def deepseek_v3_config_to_hf(c: TransformerConfig) -> dict[str, Any]:
    """The DeepseekV3Config fields of `c`; ValueError if DeepSeek-V3 cannot express it."""
    pattern = c.moe_layer_pattern
    dense = pattern.index(True) if True in pattern else c.num_layers
    shared = c.moe_shared_expert_intermediate_size
    if not (
        c.multi_latent_attention
        and c.qk_layernorm
        and c.normalization == "RMSNorm"
        and c.activation == "swiglu"
        and not c.add_bias_linear
        and not c.layernorm_zero_centered_gamma
        and c.num_moe_experts is not None
        and pattern == [False] * dense + [True] * (c.num_layers - dense)
        and c.moe_router_score_function == "sigmoid"
        and c.moe_router_enable_expert_bias
        and c.moe_expert_capacity_factor is None
        and not c.moe_shared_expert_gate
        and (shared is None or shared % c.moe_ffn_hidden_size == 0)
    ):
        raise ValueError(
            "this config is not a DeepseekV3ForCausalLM architecture (it needs multi-latent "
            "attention with latent norms, RMSNorm, SwiGLU, no biases, MoE layers after the "
            "first dense ones with sigmoid routing and expert bias, dropless, shared experts "
            "a multiple of the expert width and ungated)"
        )
    groups, group_topk = c.moe_router_num_groups, c.moe_router_group_topk
    if group_topk and c.moe_router_topk // group_topk != 2:
        raise ValueError(
            f"moe_router_topk {c.moe_router_topk} / moe_router_group_topk {group_topk} must be "
            "2 for DeepSeek-V3 (transformers scores a group by its top 2 experts)"
        )
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": c.rotary_base}
    if c.rope_type == "yarn":
        rope.update(
            rope_type="yarn",
            factor=c.rotary_scaling_factor,
            original_max_position_embeddings=c.original_max_position_embeddings,
            beta_fast=c.beta_fast,
            beta_slow=c.beta_slow,
            mscale=c.mscale,
            mscale_all_dim=c.mscale_all_dim,
        )
        if not c.yarn_correction_range_round_to_int:
            rope["truncate"] = False  # transformers' default is True
        if not c.mscale_all_dim and c.mscale != 1.0:
            raise ValueError(
                "YaRN mscale without mscale_all_dim: transformers would take 0.1·ln(s) + 1"
            )
    return dict(
        num_hidden_layers=c.num_layers,
        hidden_size=c.hidden_size,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_attention_heads,
        intermediate_size=c.ffn_hidden_size,
        moe_intermediate_size=c.moe_ffn_hidden_size,
        n_routed_experts=c.num_moe_experts,
        n_shared_experts=(shared or 0) // c.moe_ffn_hidden_size,
        num_experts_per_tok=c.moe_router_topk,
        n_group=groups or 1,
        topk_group=group_topk or 1,
        routed_scaling_factor=c.moe_router_topk_scaling_factor or 1.0,
        norm_topk_prob=True,
        first_k_dense_replace=dense,
        q_lora_rank=c.q_lora_rank,
        kv_lora_rank=c.kv_lora_rank,
        qk_nope_head_dim=c.qk_head_dim,
        qk_rope_head_dim=c.qk_pos_emb_head_dim,
        v_head_dim=c.v_head_dim,
        head_dim=c.qk_pos_emb_head_dim,
        rope_interleave=True,
        hidden_act="silu",
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.layernorm_epsilon,
        attention_bias=False,
        attention_dropout=c.attention_dropout,
        rope_parameters=rope,
        num_nextn_predict_layers=c.mtp_num_layers or 0,
    )
