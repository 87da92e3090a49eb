"""Parameter count and Megatron's FLOPs-per-iteration, from a config alone.

Both are computed arithmetically, without allocating a model, so a trainer can
log TFLOP/s for a 70B model and a planner can size one before building it.
"""

from __future__ import annotations

from mg.core.models.config import TransformerConfig


def num_parameters(config: TransformerConfig, include_embeddings: bool = True) -> int:
    """Parameters of `GPTModel(config)`; counts a tied output layer once.

    include_embeddings=False leaves out the token and position embeddings and
    the untied output layer (the "non-embedding" count of scaling-law papers).
    """
    c = config
    h = c.hidden_size
    norm = 2 * h if c.normalization == "LayerNorm" else h
    qkv_out = c.query_projection_size + 2 * c.kv_projection_size
    fc1_out = c.ffn_hidden_size * (2 if c.gated_linear_unit else 1)
    per_layer = (
        2 * norm
        + h * qkv_out
        + (qkv_out if c.add_bias_linear or c.add_qkv_bias else 0)
        + c.query_projection_size * h
        + h * fc1_out
        + c.ffn_hidden_size * h
        + ((h + fc1_out + h) if c.add_bias_linear else 0)  # linear_proj, fc1, fc2 biases
    )
    total = c.num_layers * per_layer + norm  # + final_layernorm
    if include_embeddings:
        total += c.vocab_size * h
        if c.position_embedding_type == "learned_absolute":
            total += c.max_position_embeddings * h
        if c.untie_embeddings_and_output_weights:
            total += c.vocab_size * h
    return total


def num_floating_point_operations(
    config: TransformerConfig, batch_size: int, seq_length: int | None = None
) -> float:
    """Model FLOPs of one training iteration (forward + backward), Megatron's formula:

        12·B·s·L·h²·[(1 + g + s/(2h))·q + (F/h)·k·γ] + 6·B·s·h·V

    B global batch, s sequence, L layers, h hidden, q = kv_channels·heads / h,
    g = query groups / heads, k router top-k (1 for dense), γ = 1.5 for a gated
    MLP (Megatron's `--swiglu`) else 1, F ffn width, V padded vocabulary.
    The s/(2h) term counts causal attention (half the score matrix). No
    recompute FLOPs are counted: this is the MFU numerator.
    """
    c = config
    s = seq_length if seq_length is not None else c.seq_length
    h = c.hidden_size
    q = c.kv_channels * c.num_attention_heads / h
    g = c.num_query_groups / c.num_attention_heads
    k = 1  # dense; MoE (router top-k) arrives with expert parallelism
    gamma = 1.5 if c.gated_linear_unit else 1.0
    ffn = c.ffn_hidden_size
    per_layer_h2 = (1 + g + s / (2 * h)) * q + (ffn / h) * k * gamma
    layers_term = 12 * batch_size * s * c.num_layers * h**2 * per_layer_h2
    logits_term = 6 * batch_size * s * h * c.vocab_size
    return float(layers_term + logits_term)


def throughput_tflops_per_gpu(
    flops_per_iteration: float, seconds_per_iteration: float, world_size: int
) -> float:
    """TFLOP/s per GPU as Megatron logs it."""
    return flops_per_iteration / (seconds_per_iteration * 1e12 * world_size)
