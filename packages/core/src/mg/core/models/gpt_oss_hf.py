"""gpt-oss config.json ↔ `TransformerConfig`, and its expert tensors ↔ per-expert ones.

gpt-oss's decoder is GPTModel with these settings (its weight table is
`hf_mapping.GPT_OSS`, names only, over the per-expert names below):

    sinks [heads]                    softmax_type "learnable" (core_attention.softmax_offset)
    attention_bias, expert biases    add_bias_linear (q/k/v/o, the experts' fc1/fc2)
    router weight + bias             mlp.router.weight / .bias; top-k logits, softmax over k
    clamped SwiGLU, alpha 1.702      activation "quick_geglu", glu_linear_offset 1,
                                     activation_func_clamp_value = swiglu_limit
    sliding_window W, layer_types    window_size (W - 1, 0), window_attn_skip_freq
    rope yarn (factor, betas,        rope_type "yarn" with rotary_scaling_factor, beta_fast,
      truncate, original max)        beta_slow, yarn_correction_range_round_to_int, ...

transformers keeps each layer's experts stacked and transposed: `gate_up_proj`
[E, hidden, 2·ffn] with gate and up columns interleaved (gate₀, up₀, gate₁, ...),
`down_proj` [E, ffn, hidden], and their biases [E, 2·ffn] / [E, hidden]. `unpack_experts`
turns them into per-expert Llama-style names (`mlp.experts.{e}.gate_proj.weight`
[ffn, hidden], ...) that the table maps onto Megatron's [gate; up] linear_fc1;
`pack_experts` is its inverse. Both only slice, transpose and stack, so a round trip
is bit-exact. OpenAI's released checkpoints store the expert weights as MXFP4
(`*_blocks` uint8 [E, rows, cols/32, 16], two FP4 e2m1 values a byte, low nibble
first; `*_scales` uint8 [E, rows, cols/32], a power of two biased by 127);
`dequantize_mxfp4` expands them on import, as transformers' `convert_moe_packed_tensors`
does.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import Tensor

from mg.core.models.config import TransformerConfig
from mg.core.models.hf_config_fields import decoder_shape

GPT_OSS_TYPE = "gpt_oss"
GPT_OSS_CLASS = "GptOssForCausalLM"
SWIGLU_ALPHA = 1.702
_SLIDING, _FULL = "sliding_attention", "full_attention"

MEGATRON_GPT_OSS_YARN: dict[str, Any] = {
    "position_embedding_type": "rope",
    "rope_type": "yarn",
    "rotary_scaling_factor": 32.0,
    "original_max_position_embeddings": 131072,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.0,
    "yarn_correction_range_round_to_int": False,
}
"""The `TransformerConfig` fields Megatron-LM's `--enable-gpt-oss` sets (its post-training
model builder, core_v0.19.0); a Megatron-LM checkpoint's args with that flag mean them."""

FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The 16 values of an FP4 e2m1 nibble (sign, 2 exponent bits, 1 mantissa bit)."""


def dequantize_mxfp4(blocks: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    """MXFP4 blocks [E, rows, groups, 16] and scales [E, rows, groups] → [E, groups·32, rows]
    in `dtype`: each byte holds two FP4 values (low nibble first), each group of 32
    shares the scale 2^(scale - 127); the result is transposed to transformers' layout."""
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match"
        )
    lut = torch.tensor(FP4_E2M1, dtype=dtype, device=blocks.device)
    blocks = blocks.to(torch.uint8)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)
    values = values.flatten(-2)  # [E, rows, groups, 32]
    exponents = scales.to(torch.int32) - 127
    values = torch.ldexp(values, exponents.unsqueeze(-1).to(dtype))
    return values.flatten(-2).transpose(1, 2).contiguous()


_EXPERTS = re.compile(r"^(.*\.mlp\.experts\.)(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")


def unpack_experts(hf_state: dict[str, Tensor], config: TransformerConfig) -> dict[str, Tensor]:
    """transformers' stacked (or MXFP4) expert tensors → per-expert names the table reads;
    every other tensor as it is."""
    out: dict[str, Tensor] = {}
    stacked: dict[tuple[str, str], dict[str, Tensor]] = {}
    for name, tensor in hf_state.items():
        match = _EXPERTS.match(name)
        if match is None:
            out[name] = tensor
            continue
        prefix, proj, suffix = match.groups()
        stacked.setdefault((prefix, proj), {})[suffix or ""] = tensor
    for (prefix, proj), parts in stacked.items():
        weight = parts.get("")
        if weight is None and "_blocks" in parts:
            if "_scales" not in parts:
                raise KeyError(f"{prefix}{proj}_blocks needs {prefix}{proj}_scales")
            dtype = parts["_bias"].dtype if "_bias" in parts else torch.bfloat16
            weight = dequantize_mxfp4(parts["_blocks"], parts["_scales"], dtype)
        bias = parts.get("_bias")
        for e in range(config.num_moe_experts):
            expert = f"{prefix}{e}."
            if proj == "gate_up_proj":
                if weight is not None:  # [hidden, 2·ffn], columns gate/up interleaved
                    out[expert + "gate_proj.weight"] = weight[e][:, 0::2].t().contiguous()
                    out[expert + "up_proj.weight"] = weight[e][:, 1::2].t().contiguous()
                if bias is not None:
                    out[expert + "gate_proj.bias"] = bias[e][0::2].contiguous()
                    out[expert + "up_proj.bias"] = bias[e][1::2].contiguous()
            else:
                if weight is not None:  # [ffn, hidden]
                    out[expert + "down_proj.weight"] = weight[e].t().contiguous()
                if bias is not None:
                    out[expert + "down_proj.bias"] = bias[e].contiguous()
    return out


_PER_EXPERT = re.compile(
    r"^(.*\.mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|bias)$"
)


def pack_experts(hf_state: dict[str, Tensor], config: TransformerConfig) -> dict[str, Tensor]:
    """Inverse of `unpack_experts` (never back to MXFP4): per-expert tensors → transformers'
    stacked `gate_up_proj`, `down_proj` and their biases."""
    out: dict[str, Tensor] = {}
    experts: dict[str, dict[tuple[str, str], dict[int, Tensor]]] = {}
    for name, tensor in hf_state.items():
        match = _PER_EXPERT.match(name)
        if match is None:
            out[name] = tensor
            continue
        prefix, e, proj, part = match.groups()
        experts.setdefault(prefix, {}).setdefault((proj, part), {})[int(e)] = tensor
    for prefix, parts in experts.items():

        def stacked(
            proj: str, part: str, prefix: str = prefix, parts: dict = parts
        ) -> Tensor | None:
            tensors = parts.get((proj, part))
            if tensors is None:
                return None
            count = config.num_moe_experts
            if sorted(tensors) != list(range(count)):
                raise KeyError(f"{prefix}: {proj}.{part} of experts {sorted(tensors)} only")
            return torch.stack([tensors[e] for e in range(count)])

        for part, name in (("weight", "gate_up_proj"), ("bias", "gate_up_proj_bias")):
            gate, up = stacked("gate_proj", part), stacked("up_proj", part)
            if gate is None:
                continue
            if part == "weight":  # [E, ffn, hidden] each → [E, hidden, 2·ffn] interleaved
                gate, up = gate.transpose(1, 2), up.transpose(1, 2)
            out[prefix + name] = torch.stack([gate, up], dim=-1).flatten(-2).contiguous()
        down = stacked("down_proj", "weight")
        if down is not None:
            out[prefix + "down_proj"] = down.transpose(1, 2).contiguous()
        down_bias = stacked("down_proj", "bias")
        if down_bias is not None:
            out[prefix + "down_proj_bias"] = down_bias.contiguous()
    return out


def _skip_freq(layer_types: list[str]) -> int | list[int] | None:
    """Megatron's window_attn_skip_freq of HF's layer_types (None: all slide)."""
    sliding = [t == _SLIDING for t in layer_types]
    if all(sliding):
        return None
    for n in range(1, len(sliding) + 1):
        if sliding == [(i + 1) % n != 0 for i in range(len(sliding))]:
            return n
    return [int(s) for s in sliding]


def _yarn_of(c: dict[str, Any]) -> dict[str, Any]:
    """The RoPE fields of a gpt-oss config (transformers 5's rope_parameters or 4's
    rope_theta / rope_scaling)."""
    rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    base = float(rope.get("rope_theta", c.get("rope_theta", 150000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return dict(rotary_base=base)
    if kind != "yarn":
        raise ValueError(f"gpt-oss rope_type {kind!r} is not supported (only 'yarn', 'default')")
    if rope.get("attention_factor") is not None:
        raise ValueError("gpt-oss rope attention_factor is not supported (YaRN's mscale is)")
    return dict(
        rotary_base=base,
        rope_type="yarn",
        rotary_scaling_factor=float(rope["factor"]),
        original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        beta_fast=float(rope.get("beta_fast", 32.0)),
        beta_slow=float(rope.get("beta_slow", 1.0)),
        mscale=float(rope.get("mscale") or 1.0),
        mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0),
        yarn_correction_range_round_to_int=bool(rope.get("truncate", True)),
    )


def gpt_oss_config_from_hf(c: dict[str, Any]) -> dict[str, Any]:
    """`TransformerConfig` fields of a GptOssConfig dict; ValueError names what this
    decoder cannot run."""
    if float(c.get("swiglu_alpha", SWIGLU_ALPHA)) != SWIGLU_ALPHA:
        raise ValueError(
            f"gpt-oss swiglu_alpha {c['swiglu_alpha']}: only {SWIGLU_ALPHA} (Megatron's "
            "quick_gelu) is supported"
        )
    if not c.get("attention_bias", True):
        raise ValueError(
            "gpt-oss attention_bias false (biases on the experts and router but not q/k/v/o) "
            "cannot be expressed with Megatron's add_bias_linear"
        )
    layers = c["num_hidden_layers"]
    window = c.get("sliding_window")
    layer_types = c.get("layer_types") or [
        _SLIDING if (i + 1) % 2 else _FULL for i in range(layers)
    ]
    if not window and _SLIDING in layer_types:
        raise ValueError("gpt-oss layer_types has sliding layers but sliding_window is null")
    experts = c.get("num_local_experts") or c["num_experts"]
    return dict(
        **decoder_shape(c, eps=1e-5, num_layers=layers),
        activation="quick_geglu",
        glu_linear_offset=1.0,
        activation_func_clamp_value=float(c.get("swiglu_limit", 7.0)),
        add_bias_linear=True,
        softmax_type="learnable",
        window_size=(window - 1, 0) if window else None,
        window_attn_skip_freq=_skip_freq(layer_types) if window else None,
        untie_embeddings_and_output_weights=not c.get("tie_word_embeddings", False),
        init_method_std=c.get("initializer_range", 0.02),
        attention_dropout=float(c.get("attention_dropout", 0.0)),
        hidden_dropout=0.0,
        num_moe_experts=experts,
        moe_ffn_hidden_size=c["intermediate_size"],
        moe_router_topk=c["num_experts_per_tok"],
        moe_aux_loss_coeff=float(c.get("router_aux_loss_coef", 0.0)),
        **_yarn_of(c),
    )


def gpt_oss_config_to_hf(c: TransformerConfig) -> dict[str, Any]:
    """The config.json of `c` as GptOssForCausalLM; ValueError if gpt-oss cannot express it."""
    clamp = c.activation_func_clamp_value
    if not (
        c.position_embedding_type == "rope"
        and c.rotary_percent == 1.0
        and c.normalization == "RMSNorm"
        and not c.layernorm_zero_centered_gamma
        and c.activation == "quick_geglu"
        and c.glu_linear_offset == 1.0
        and clamp is not None
        and c.add_bias_linear
        and c.softmax_type == "learnable"
        and c.num_moe_experts is not None
        and all(c.moe_layer_pattern)
        and c.moe_router_score_function == "softmax"
        and not c.moe_router_pre_softmax
        and not c.moe_router_topk_scaling_factor
        and not c.moe_router_group_topk
        and c.moe_expert_capacity_factor is None
        and not c.moe_router_enable_expert_bias
        and c.moe_shared_expert_intermediate_size is None
        and not c.qk_layernorm
        and not c.sandwich_norms
        and c.softmax_scale is None
        and c.rope_scaling is None
        and c.rotary_seq_len_interpolation_factor is None
        and c.rotary_base_local is None
        and not c.scale_embeddings_by_sqrt_hidden
    ):
        raise ValueError(
            "this config is not a GptOssForCausalLM architecture (it needs RoPE, RMSNorm, "
            "quick_geglu with offset 1 and a clamp, biases, learnable sinks, and MoE in every "
            "layer with top-k softmax routing and no shared experts)"
        )
    layer_types = [_SLIDING if c.is_window_layer(i + 1) else _FULL for i in range(c.num_layers)]
    if c.window_size is None:
        layer_types = [_FULL] * c.num_layers
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": c.rotary_base}
    if c.rope_type == "yarn":
        if c.mscale != 1.0 or c.mscale_all_dim != 0.0:
            raise ValueError("gpt-oss's YaRN takes mscale 1 and mscale_all_dim 0 only")
        rope = dict(
            rope_type="yarn",
            rope_theta=c.rotary_base,
            factor=c.rotary_scaling_factor,
            beta_fast=c.beta_fast,
            beta_slow=c.beta_slow,
            truncate=c.yarn_correction_range_round_to_int,
            original_max_position_embeddings=c.original_max_position_embeddings,
        )
    return dict(
        architectures=[GPT_OSS_CLASS],
        model_type=GPT_OSS_TYPE,
        vocab_size=c.vocab_size,
        tie_word_embeddings=not c.untie_embeddings_and_output_weights,
        initializer_range=c.init_method_std,
        num_hidden_layers=c.num_layers,
        hidden_size=c.hidden_size,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_query_groups,
        head_dim=c.kv_channels,
        intermediate_size=c.moe_ffn_hidden_size,
        num_local_experts=c.num_moe_experts,
        num_experts_per_tok=c.moe_router_topk,
        router_aux_loss_coef=c.moe_aux_loss_coeff,
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.layernorm_epsilon,
        attention_bias=True,
        attention_dropout=c.attention_dropout,
        sliding_window=c.window_size[0] + 1 if c.window_size is not None else None,
        layer_types=layer_types,
        rope_parameters=rope,
        swiglu_alpha=SWIGLU_ALPHA,
        swiglu_limit=clamp,
        hidden_act="silu",
    )
