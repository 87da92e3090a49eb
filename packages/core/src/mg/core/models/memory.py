"""Per-GPU memory of a training run, from a config and a parallel layout alone.

Pure arithmetic (no model is allocated), so a 175B run can be planned on a
laptop. Three parts per rank, for every pipeline stage:

- parameters held: the stage's layers (L/p of them, Megatron's even split), the
  word embeddings on the first stage (vocab-parallel, split by t), the position
  embeddings too, the final norm and the output layer on the last; with tied
  embeddings and p > 1 the last stage holds its own copy of the word embeddings
  (Megatron's tied-embedding copy). Column/row-parallel matrices are split by t;
  norms and the row-parallel biases are replicated.
- weights, gradients and optimizer state: bytes per parameter from Megatron's
  distributed-optimizer table (REFERENCE §7), d = data-parallel size:

      params / grads   regular   distributed
      fp16 / fp16      20        4 + 16/d
      bf16 / fp32      18        6 + 12/d
      fp32 / fp32      16        8 + 8/d

- activations: Korthikanti et al., "Reducing Activation Recomputation in Large
  Transformer Models" (2022), Table 2. Per layer and micro-batch, with 16-bit
  activations and 1-byte dropout masks, s sequence, b micro-batch, h hidden,
  a heads, t tensor-parallel size:

      no recompute, TP only        sbh·(10 + 24/t + 5·a·s/(h·t))
      no recompute, TP + SP        sbh·(34 + 5·a·s/h) / t
      selective recompute (+ SP)   34·sbh / t
      full recompute               2·sbh per checkpointed layer (its input only)

  Here the same terms are derived from the tensors each op saves, so they also
  hold for fp32 activations, GQA, SwiGLU and FFN widths other than 4h, and
  without dropout (no masks); with RMSNorm and RoPE, which run unfused here,
  their extra saved tensors are counted too. The 5as² term is the attention score matrix; a
  fused attention kernel (PyTorch SDPA, flash-attn) does not keep it and
  stores only a·s·b fp32 log-sum-exps. The first pipeline stage holds
  min(p, micro-batches) micro-batches in flight under 1F1B.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

from mg.core.models.config import TransformerConfig
from mg.core.models.flops import (
    layer_norms,
    mla_parameters,
    mlp_parameters,
    num_floating_point_operations,
    num_parameters,
)

Precision = Literal["fp32", "bf16", "fp16"]
_ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


class MemoryEstimateError(ValueError):
    """A layout the estimate (and Megatron) cannot split the model into."""


@dataclass(frozen=True)
class BytesPerParameter:
    """REFERENCE §7's bytes per parameter, split into what each part holds."""

    params: float
    grads: float
    optimizer_state: float  # main params + main grads + optimizer moments (sharded if distributed)

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer_state


def bytes_per_parameter(
    param_dtype: Precision,
    distributed_optimizer: bool,
    data_parallel_size: int = 1,
    optimizer: Literal["adam", "sgd"] = "adam",
) -> BytesPerParameter:
    """Bytes per parameter on one rank (Megatron's mixed-precision layout).

    fp16 params keep fp16 grads plus fp32 main params and main grads; bf16
    params keep fp32 grads and fp32 main params; fp32 params are their own
    main copy. Adam adds two fp32 moments (8 bytes), SGD one momentum (4).
    The distributed optimizer divides the fp32 part by d."""
    if param_dtype not in _ELEMENT_BYTES:
        raise MemoryEstimateError(f"param_dtype must be fp32, bf16 or fp16, got {param_dtype!r}")
    moments = {"adam": 8, "sgd": 4}[optimizer]
    params = _ELEMENT_BYTES[param_dtype]
    grads = 2 if param_dtype == "fp16" else 4
    main = {"fp32": 0, "bf16": 4, "fp16": 8}[param_dtype]  # main params (+ main grads for fp16)
    state = float(main + moments)
    if distributed_optimizer:
        state /= data_parallel_size
    return BytesPerParameter(float(params), float(grads), state)


# --- parameters ---------------------------------------------------------------------------------


def _check_divisible(config: TransformerConfig, tp: int, pp: int) -> None:
    c = config
    for name, value in (
        ("num_attention_heads", c.num_attention_heads),
        ("num_query_groups", c.num_query_groups),
        ("ffn_hidden_size", c.ffn_hidden_size),
        ("vocab_size", c.vocab_size),
    ):
        if value % tp:
            raise MemoryEstimateError(
                f"{name} ({value}) is not divisible by the tensor-parallel size ({tp})"
            )
    if c.num_layers % pp:
        raise MemoryEstimateError(
            f"number of layers ({c.num_layers}) is not divisible by the pipeline-parallel "
            f"size ({pp})"
        )


def layer_parameters(config: TransformerConfig, tp: int = 1) -> int:
    """Parameters of one dense transformer layer on one tensor-parallel rank."""
    c = config
    h = c.hidden_size
    qkv_out = c.query_projection_size + 2 * c.kv_projection_size
    fc1_out = c.ffn_hidden_size * (2 if c.gated_linear_unit else 1)
    split = h * qkv_out + c.query_projection_size * h + h * fc1_out + c.ffn_hidden_size * h
    split_bias = (qkv_out if c.add_bias_linear or c.add_qkv_bias else 0) + (
        fc1_out if c.add_bias_linear else 0
    )
    # the norms (sandwich and q/k norms too) and the row-parallel biases
    replicated = layer_norms(c) + (2 * h if c.add_bias_linear else 0)
    if c.multi_latent_attention:  # its attention: heads split, latents whole
        split = h * fc1_out + c.ffn_hidden_size * h
        split_bias = fc1_out if c.add_bias_linear else 0
        replicated = layer_norms(c) + (h if c.add_bias_linear else 0) + mla_parameters(c, tp)
    return (split + split_bias) // tp + replicated


def moe_layer_parameters(
    config: TransformerConfig, tp: int = 1, ep: int = 1, etp: int | None = None
) -> tuple[int, int]:
    """(non-expert, routed-expert) parameters of one MoE layer on one rank: attention
    and shared experts split by tp, the router replicated, the routed experts split
    over ep (whole experts) × etp (inside each, default tp)."""
    etp = tp if etp is None else etp
    dense_mlp = mlp_parameters(config, moe=False)
    non_expert = layer_parameters(config, tp) - dense_mlp // tp
    c = config
    h = c.hidden_size
    router = c.num_moe_experts * h + (c.num_moe_experts if c.add_bias_linear else 0)
    shared = mlp_parameters(config, moe=True) - router - c.num_moe_experts * _expert(c)
    experts = c.num_moe_experts * _expert(c) // (ep * etp)
    return non_expert + router + shared // tp, experts


def _expert(config: TransformerConfig) -> int:
    c = config
    h, ffn = c.hidden_size, c.moe_ffn_hidden_size
    gate = 2 if c.gated_linear_unit else 1
    return h * ffn * gate + ffn * h + ((ffn * gate + h) if c.add_bias_linear else 0)


def stage_parameters(
    config: TransformerConfig, tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None
) -> list[int]:
    """Parameters held by one tensor-parallel rank of each pipeline stage."""
    _check_divisible(config, tp, pp)
    c = config
    h = c.hidden_size
    norm = 2 * h if c.normalization == "LayerNorm" else h
    word = c.vocab_size * h // tp
    per_stage = c.num_layers // pp
    pattern = c.moe_layer_pattern
    stages = [
        sum(
            sum(moe_layer_parameters(c, tp, ep, etp)) if moe else layer_parameters(c, tp)
            for moe in pattern[i * per_stage : (i + 1) * per_stage]
        )
        for i in range(pp)
    ]
    stages[0] += word
    if c.position_embedding_type == "learned_absolute":
        stages[0] += c.max_position_embeddings * h
    stages[-1] += norm
    if c.untie_embeddings_and_output_weights or pp > 1:
        stages[-1] += word  # own output layer, or the tied copy of the word embeddings
    if c.mtp_num_layers:  # on the last stage: norms, eh_proj (column-parallel), a layer each
        last = pattern[-1]
        layer = sum(moe_layer_parameters(c, tp, ep, etp)) if last else layer_parameters(c, tp)
        stages[-1] += c.mtp_num_layers * (3 * norm + 2 * h * h // tp + layer)
        if pp > 1 and c.untie_embeddings_and_output_weights:
            stages[-1] += word  # the last stage's embedding copy for the MTP block
    return stages


# --- activations --------------------------------------------------------------------------------


def layer_activation_bytes(
    config: TransformerConfig,
    micro_batch_size: int,
    seq_length: int,
    *,
    tp: int = 1,
    sequence_parallel: bool = False,
    activation_dtype: Precision = "bf16",
    recompute: Literal["none", "selective", "full"] = "none",
    fused_attention: bool = False,
) -> float:
    """Bytes one layer keeps for backward, per micro-batch (Korthikanti et al., Table 2).

    With the paper's assumptions (16-bit, dropout on, 4h MLP, MHA, unfused
    attention) this is sbh·(10 + 24/t + 5as/(ht)) without SP and
    sbh·(34 + 5as/h)/t with SP; "full" is the layer input only (2sbh, /t with SP)."""
    c = config
    s, b, h, a = seq_length, micro_batch_size, c.hidden_size, c.num_attention_heads
    e = _ELEMENT_BYTES[activation_dtype]
    sbh = s * b * h
    replicated_div = tp if sequence_parallel else 1
    if recompute == "full":
        return e * sbh / replicated_div
    mask = 1 if c.hidden_dropout > 0 else 0
    attn_mask = 1 if c.attention_dropout > 0 else 0
    # Replicated without SP: LN1 input, QKV input, LN2 input, fc1 input, two dropout masks.
    replicated = sbh * (4 * e + 2 * mask)
    # Split by t: Q, K, V, the attention output (linear_proj input), the MLP activation
    # input and output (linear_fc2 input); a gated MLP also keeps act(gate) and up.
    f = c.ffn_hidden_size
    mlp = 4 * f if c.gated_linear_unit else 2 * f
    qkv = 2 * c.query_projection_size + 2 * c.kv_projection_size
    if c.position_embedding_type == "rope":  # q and k before rotation (unfused RoPE)
        qkv += c.query_projection_size + c.kv_projection_size
    split = s * b * (qkv + mlp) * e
    if c.normalization == "RMSNorm":  # unfused RMSNorm also keeps its normalized input
        replicated += 2 * sbh * e
    if c.sandwich_norms:  # the post-norms' inputs (and normalized inputs for RMSNorm)
        replicated += (4 if c.normalization == "RMSNorm" else 2) * sbh * e
    if fused_attention:
        split += a * s * b * 4  # fp32 log-sum-exp per row
    elif recompute != "selective":
        # softmax output, dropout mask, dropout output (5as²b in the paper).
        split += a * s * s * b * (e + attn_mask * (1 + e))
    return replicated / replicated_div + split / tp


def _embedding_activation_bytes(
    config: TransformerConfig, b: int, s: int, tp: int, sp: bool, e: int
) -> tuple[float, float]:
    """(first stage, last stage) extras: the embedding output and its dropout mask; the
    final norm input, the output layer input and the fp32 log-softmax of the logits."""
    sbh = s * b * config.hidden_size
    div = tp if sp else 1
    first = sbh * (e + (1 if config.hidden_dropout > 0 else 0)) / div
    last = 2 * e * sbh / div + 4 * s * b * config.vocab_size / tp
    return first, last


# --- the whole estimate -------------------------------------------------------------------------


@dataclass(frozen=True)
class StageMemory:
    """One rank of one pipeline stage."""

    stage: int
    parameters: int
    weights: float
    gradients: float
    optimizer_state: float
    activations: float
    activations_no_recompute: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer_state + self.activations


@dataclass(frozen=True)
class MemoryEstimate:
    """What `estimate_memory` found: totals, FLOPs and every stage's bytes."""

    total_parameters: int
    flops_per_iteration: float
    bytes_per_parameter: BytesPerParameter
    stages: list[StageMemory]
    in_flight_micro_batches: int

    @property
    def most_loaded(self) -> StageMemory:
        return max(self.stages, key=lambda st: st.total)


def estimate_memory(
    config: TransformerConfig,
    *,
    micro_batch_size: int,
    global_batch_size: int,
    seq_length: int | None = None,
    tp: int = 1,
    pp: int = 1,
    dp: int = 1,
    sequence_parallel: bool = False,
    param_dtype: Precision = "fp32",
    activation_dtype: Precision = "fp32",
    distributed_optimizer: bool = False,
    optimizer: Literal["adam", "sgd"] = "adam",
    recompute_granularity: Literal["selective", "full"] | None = None,
    recompute_method: Literal["uniform", "block"] = "uniform",
    recompute_num_layers: int = 1,
    fused_attention: bool = False,
    ep: int = 1,
    etp: int | None = None,
) -> MemoryEstimate:
    """Per-rank bytes for each pipeline stage of a run (see the module docstring).

    MoE: a rank holds its ep-th of the routed experts (split by etp inside); their
    optimizer state is sharded over the expert data-parallel ranks, dp·tp / (ep·etp).
    A layer's activations are counted as the larger of a dense and an MoE layer's,
    the MoE layer's MLP taken as k·moe_ffn (+ shared) wide: each token runs through
    k experts."""
    s = seq_length if seq_length is not None else config.seq_length
    b = micro_batch_size
    if global_batch_size % (b * dp):
        raise MemoryEstimateError(
            f"global batch size ({global_batch_size}) is not divisible by micro batch size "
            f"({b}) x data-parallel size ({dp})"
        )
    num_micro = global_batch_size // (b * dp)
    per_param = bytes_per_parameter(param_dtype, distributed_optimizer, dp, optimizer)
    params = stage_parameters(config, tp, pp, ep, etp)
    expert_dp = max(dp * tp // (ep * (tp if etp is None else etp)), 1)
    per_expert_param = bytes_per_parameter(param_dtype, distributed_optimizer, expert_dp, optimizer)
    per_stage_layers = config.num_layers // pp
    expert_layers = [
        sum(config.moe_layer_pattern[i * per_stage_layers : (i + 1) * per_stage_layers])
        for i in range(pp)
    ]
    if config.mtp_num_layers and config.moe_layer_pattern[-1]:  # MoE MTP layers, last stage
        expert_layers[-1] += config.mtp_num_layers
    expert_params = [
        count * (moe_layer_parameters(config, tp, ep, etp)[1] if config.num_moe_experts else 0)
        for count in expert_layers
    ]
    layers = config.num_layers // pp
    e = _ELEMENT_BYTES[activation_dtype]

    moe_as_dense = None
    if config.num_moe_experts is not None and any(config.moe_layer_pattern):
        width = config.moe_ffn_hidden_size * config.moe_router_topk
        moe_as_dense = dataclasses.replace(
            config,
            num_moe_experts=None,
            moe_ffn_hidden_size=None,
            ffn_hidden_size=width + (config.moe_shared_expert_intermediate_size or 0),
        )

    def per_layer(mode: str) -> float:
        return max(
            layer_activation_bytes(
                layer_config,
                b,
                s,
                tp=tp,
                sequence_parallel=sequence_parallel,
                activation_dtype=activation_dtype,
                recompute=mode,
                fused_attention=fused_attention,
            )
            for layer_config in (config, moe_as_dense)
            if layer_config is not None
        )

    plain = per_layer("none")
    if recompute_granularity == "selective":
        stored = layers * per_layer("selective")
    elif recompute_granularity == "full":
        n = max(1, min(recompute_num_layers, layers))
        if recompute_method == "uniform":  # each chunk of n layers keeps only its input
            stored = math.ceil(layers / n) * per_layer("full")
        else:  # block: the first n layers keep their input, the rest everything
            stored = n * per_layer("full") + (layers - n) * plain
    else:
        stored = layers * plain
    first_extra, last_extra = _embedding_activation_bytes(config, b, s, tp, sequence_parallel, e)
    stages = []
    for stage, count in enumerate(params):
        in_flight = min(pp - stage, num_micro)  # 1F1B: stage i keeps p - i micro-batches
        extra = (first_extra if stage == 0 else 0.0) + (last_extra if stage == pp - 1 else 0.0)
        stages.append(
            StageMemory(
                stage=stage,
                parameters=count,
                weights=count * per_param.params,
                gradients=count * per_param.grads,
                optimizer_state=(count - expert_params[stage]) * per_param.optimizer_state
                + expert_params[stage] * per_expert_param.optimizer_state,
                activations=in_flight * (stored + extra),
                activations_no_recompute=in_flight * (layers * plain + extra),
            )
        )
    return MemoryEstimate(
        total_parameters=num_parameters(config),
        flops_per_iteration=num_floating_point_operations(config, global_batch_size, s),
        bytes_per_parameter=per_param,
        stages=stages,
        in_flight_micro_batches=min(pp, num_micro),
    )
