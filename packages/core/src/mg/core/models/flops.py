"""Parameter count and Megatron's FLOPs-per-iteration, from a config alone.

Both are computed arithmetically, without allocating a model, so a trainer can
log TFLOP/s for a 70B model and a planner can size one before building it.
"""

from __future__ import annotations

from mg.core.models.config import TransformerConfig


def mlp_parameters(config: TransformerConfig, moe: bool, active: bool = False) -> int:
    """Parameters of one layer's MLP: the dense MLP, or an MoE layer's router, routed
    experts (all of them, or the top-k a token uses with `active`) and shared experts."""
    c = config
    h = c.hidden_size
    gate = 2 if c.gated_linear_unit else 1

    def mlp(ffn: int) -> int:
        return h * ffn * gate + ffn * h + ((ffn * gate + h) if c.add_bias_linear else 0)

    if not moe:
        return mlp(c.ffn_hidden_size)
    experts = c.moe_router_topk if active else c.num_moe_experts
    router = c.num_moe_experts * h + (c.num_moe_experts if c.add_bias_linear else 0)
    shared = 0
    if c.moe_shared_expert_intermediate_size:
        shared = mlp(c.moe_shared_expert_intermediate_size) + (h if c.moe_shared_expert_gate else 0)
    return router + experts * mlp(c.moe_ffn_hidden_size) + shared


def num_parameters(
    config: TransformerConfig,
    include_embeddings: bool = True,
    active: bool = False,
    include_mtp: bool = True,
) -> int:
    """Parameters of `GPTModel(config)`; counts a tied output layer once.

    include_embeddings=False leaves out the token and position embeddings and
    the untied output layer (the "non-embedding" count of scaling-law papers).
    active=True counts what one token uses: in MoE layers the router, its top-k
    routed experts and the shared experts instead of every expert.
    include_mtp=False leaves out the multi-token prediction block (DeepSeek-V3's
    671B is its main model, 14B of MTP besides).
    """
    c = config
    h = c.hidden_size
    norm = 2 * h if c.normalization == "LayerNorm" else h
    attention = attention_parameters(c)
    total = norm  # final_layernorm
    for moe in c.moe_layer_pattern:
        total += attention + mlp_parameters(c, moe, active)
    if include_mtp and c.mtp_num_layers:
        # each depth: enorm, hnorm, final norm, eh_proj [h, 2h], a layer of the last kind
        last = attention + mlp_parameters(c, c.moe_layer_pattern[-1], active)
        total += c.mtp_num_layers * (3 * norm + 2 * h * h + last)
    if include_embeddings:
        total += c.vocab_size * h
        if c.position_embedding_type == "learned_absolute":
            total += c.max_position_embeddings * h
        if c.untie_embeddings_and_output_weights:
            total += c.vocab_size * h
    return total


def attention_parameters(config: TransformerConfig) -> int:
    """One layer's attention with the layer's norms (`layer_norms`): SelfAttention's fused
    QKV, or multi-latent attention's projections and latent norms (`mla_parameters`)."""
    c = config
    h = c.hidden_size
    if c.multi_latent_attention:
        return layer_norms(c) + mla_parameters(c)
    qkv_out = c.query_projection_size + 2 * c.kv_projection_size
    return (
        layer_norms(c)
        + h * qkv_out
        + (qkv_out if c.add_bias_linear or c.add_qkv_bias else 0)
        + c.query_projection_size * h
        + (h if c.add_bias_linear else 0)  # linear_proj bias
        + (c.num_attention_heads if c.softmax_type == "learnable" else 0)  # the sinks
    )


def mla_parameters(config: TransformerConfig, tp: int = 1) -> int:
    """Multi-latent attention's parameters on one tensor-parallel rank (mg.core.models.mla):
    the per-head up projections and linear_proj split by tp, the down projections and
    the latent norms whole."""
    c = config
    h, heads = c.hidden_size, c.num_attention_heads
    q_head = c.qk_head_dim + c.qk_pos_emb_head_dim
    norm = 2 if c.normalization == "LayerNorm" else 1
    if c.q_lora_rank is None:
        split, whole = h * heads * q_head, 0
    else:
        split = c.q_lora_rank * heads * q_head
        whole = h * c.q_lora_rank + (norm * c.q_lora_rank if c.qk_layernorm else 0)
    split += c.kv_lora_rank * heads * (c.qk_head_dim + c.v_head_dim) + heads * c.v_head_dim * h
    whole += h * (c.kv_lora_rank + c.qk_pos_emb_head_dim)
    whole += norm * c.kv_lora_rank if c.qk_layernorm else 0
    whole += h if c.add_bias_linear else 0  # linear_proj's bias
    return split // tp + whole


def layer_norms(config: TransformerConfig) -> int:
    """Norm parameters of one layer: the two pre-norms, Gemma's two post-norms with
    sandwich_norms, and the per-head query/key norms with qk_layernorm."""
    c = config
    norm = 2 * c.hidden_size if c.normalization == "LayerNorm" else c.hidden_size
    head_norm = 2 * c.kv_channels if c.normalization == "LayerNorm" else c.kv_channels
    per_head = c.qk_layernorm and not c.multi_latent_attention  # MLA norms its latents
    return (4 if c.sandwich_norms else 2) * norm + (2 * head_norm if per_head else 0)


def attended_keys(config: TransformerConfig, layer_number: int, seq_length: int) -> float:
    """Keys a query attends on average, as Megatron's causal count has it (s/2); a
    sliding window of W keys attends W - W²/(2s) (the same integral, capped at W)."""
    window = config.layer_window_size(layer_number)
    keys = window[0] + 1 if window is not None else seq_length
    if keys >= seq_length:
        return seq_length / 2
    return keys - keys * keys / (2 * seq_length)


def num_floating_point_operations(
    config: TransformerConfig, batch_size: int, seq_length: int | None = None
) -> float:
    """Model FLOPs of one training iteration (forward + backward), Megatron's formula:

        12·B·s·L·h²·[(1 + g + s/(2h))·q + (F/h)·k·γ] + 6·B·s·h·V

    B global batch, s sequence, L layers, h hidden, q = kv_channels·heads / h,
    g = query groups / heads, k router top-k (1 for dense), γ = 1.5 for a gated
    MLP (Megatron's `--swiglu`) else 1, F ffn width, V padded vocabulary.
    The s/(2h) term counts causal attention (half the score matrix); a
    sliding-window layer counts the keys its window lets it see instead
    (`attended_keys`). No recompute FLOPs are counted: this is the MFU numerator.

    MoE layers (per `moe_layer_freq`) count F·k as moe_ffn_hidden_size · top-k
    plus the shared experts' width, as Megatron's `num_floating_point_operations`
    does; the router's E·h product is left out, as there.

    Multi-token prediction (`mtp_num_layers` D) counts as Megatron does: D more layers of
    the last layer's kind, each depth's norms and eh_proj 6·B·s·(3h + 2h²), and D more
    logits 6·B·s·h·V.
    """
    c = config
    s = seq_length if seq_length is not None else c.seq_length
    h = c.hidden_size
    q = c.kv_channels * c.num_attention_heads / h
    g = c.num_query_groups / c.num_attention_heads
    gamma = 1.5 if c.gated_linear_unit else 1.0
    dense_ffn = c.ffn_hidden_size  # k = 1
    moe_ffn = 0
    if c.num_moe_experts is not None:
        moe_ffn = c.moe_ffn_hidden_size * c.moe_router_topk
        moe_ffn += c.moe_shared_expert_intermediate_size or 0
    mtp = c.mtp_num_layers or 0
    kinds = c.moe_layer_pattern + c.moe_layer_pattern[-1:] * mtp  # MTP: the last layer's kind
    per_layers_h2 = sum(
        _attention_h2(c, attended_keys(c, i + 1, s), q, g)
        + ((moe_ffn if moe else dense_ffn) / h) * gamma
        for i, moe in enumerate(kinds)
    )
    layers_term = 12 * batch_size * s * h**2 * per_layers_h2
    mtp_term = 6 * batch_size * s * mtp * (3 * h + 2 * h * h)  # its norms and eh_proj
    logits_term = 6 * batch_size * s * h * c.vocab_size * (1 + mtp)
    return float(layers_term + mtp_term + logits_term)


def _attention_h2(c: TransformerConfig, attended: float, q: float, g: float) -> float:
    """A layer's attention FLOPs per token in units of 12·h²: (1 + g + keys/h)·q, or
    multi-latent attention's as Megatron counts them (its latent projections, RoPE key,
    output projection, and q·k over qk_head_dim + qk_pos_emb_head_dim, p·v over v_head_dim)."""
    h = c.hidden_size
    if not c.multi_latent_attention:
        return (1 + g + attended / h) * q
    heads, q_head = c.num_attention_heads, c.qk_head_dim + c.qk_pos_emb_head_dim
    if c.q_lora_rank is None:
        q_term = h * heads * q_head
    else:
        q_term = c.q_lora_rank * (h + heads * q_head + 1)
    linear = (
        q_term
        + c.kv_lora_rank * (h + heads * (c.qk_head_dim + c.v_head_dim) + 1)
        + h * c.qk_pos_emb_head_dim
        + heads * c.v_head_dim * h
    )
    core = attended * heads * (q_head + c.v_head_dim)
    return (linear + core) / (2 * h * h)


def throughput_tflops_per_gpu(
    flops_per_iteration: float, seconds_per_iteration: float, world_size: int
) -> float:
    """TFLOP/s per GPU as Megatron logs it."""
    return flops_per_iteration / (seconds_per_iteration * 1e12 * world_size)
