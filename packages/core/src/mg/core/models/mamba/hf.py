"""Hugging Face `Mamba2ForCausalLM` and `NemotronHForCausalLM` ↔ our `MambaModel`.

Mamba2ForCausalLM has Mamba layers only. The weights need no layout change:
transformers' `Mamba2Mixer` uses the same parameter names and the same in_proj
row order (z, x, B, C, dt) as megatron-core's `MambaMixer`, so the table below
is renames only, in the form `hf_mapping` interprets (`hf_to_megatron` /
`megatron_to_hf` with `MAMBA2`), and a round trip is bit-exact.

NemotronHForCausalLM is the hybrid: one block per letter of Megatron's pattern
(`layers_block_type` in its config: "linear_attention" M, "full_attention" *,
"mlp" -), each `norm` → `mixer` → residual add, which is our MambaLayer /
AttentionLayer / MLPLayer. Its every block names its norm `norm` and its
module `mixer`, so the table depends on the pattern (`nemotron_h_architecture`):
attention's q/k/v are fused into linear_qkv (the "qkv" layout), the MLP is
non-gated (up_proj → linear_fc1, squared ReLU, down_proj → linear_fc2), no
positional embeddings. What it has that MambaModel has not (MoE blocks, biases,
tied embeddings in name only, multi-token prediction) is refused by name.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from mg.core.models.hf_mapping import HFArchitecture, WeightRule
from mg.core.models.mamba.config import MambaConfig

_MIXER_TENSORS = (
    "in_proj.weight",
    "conv1d.weight",
    "conv1d.bias",
    "dt_bias",
    "A_log",
    "D",
    "norm.weight",
    "out_proj.weight",
)

MAMBA2 = HFArchitecture(
    model_type="mamba2",
    hf_class="Mamba2ForCausalLM",
    base_model_prefix="backbone.",
    rules=(
        WeightRule("embedding.word_embeddings.weight", ("backbone.embeddings.weight",)),
        WeightRule("decoder.layers.{i}.norm.weight", ("backbone.layers.{i}.norm.weight",)),
        *(
            WeightRule(f"decoder.layers.{{i}}.mixer.{t}", (f"backbone.layers.{{i}}.mixer.{t}",))
            for t in _MIXER_TENSORS
        ),
        WeightRule("decoder.final_norm.weight", ("backbone.norm_f.weight",)),
        WeightRule("output_layer.weight", ("lm_head.weight",)),
    ),
)


def _as_dict(hf_config: Any) -> dict[str, Any]:
    return dict(hf_config) if isinstance(hf_config, Mapping) else hf_config.to_dict()


def _as_float(value: Any) -> float:
    """A float from config.json, where transformers writes inf as {"__float__": "Infinity"}."""
    if isinstance(value, Mapping) and "__float__" in value:
        return float(value["__float__"])
    return float(value)


def mamba2_config_from_hf(hf_config: Any, **overrides: Any) -> MambaConfig:
    """A `Mamba2Config` (or its config.json dict) → `MambaConfig`; what our model
    cannot express (projection biases, no conv bias, another activation, a dt
    clamp) is refused by name. num_attention_heads is set to 1: unused, but
    required (as by Megatron)."""
    c = _as_dict(hf_config)
    if c.get("use_bias", False):
        raise ValueError("Mamba2 use_bias=True: Megatron's MambaMixer has no projection biases")
    if not c.get("use_conv_bias", True):
        raise ValueError("Mamba2 use_conv_bias=False is not supported (the conv1d has a bias)")
    if c.get("hidden_act", "silu") != "silu":
        raise ValueError(f"Mamba2 hidden_act {c['hidden_act']!r} is not supported (only 'silu')")
    limit = tuple(_as_float(v) for v in c.get("time_step_limit", (0.0, math.inf)))
    if limit[0] > 0.0 or limit[1] != math.inf:
        raise ValueError(f"Mamba2 time_step_limit {limit} (a dt clamp) is not supported")
    hidden = c["hidden_size"]
    heads, head_dim = c["num_heads"], c["head_dim"]
    if heads * head_dim != int(c.get("expand", 2) * hidden):
        raise ValueError(
            f"Mamba2 num_heads · head_dim ({heads} · {head_dim}) != expand · hidden_size"
        )
    fields: dict[str, Any] = dict(
        num_layers=c["num_hidden_layers"],
        hidden_size=hidden,
        num_attention_heads=1,
        vocab_size=c["vocab_size"],
        mamba_num_heads=heads,
        mamba_head_dim=head_dim,
        mamba_state_dim=c["state_size"],
        mamba_num_groups=c["n_groups"],
        mamba_conv_kernel=c.get("conv_kernel", 4),
        mamba_chunk_size=c.get("chunk_size", 256),
        normalization="RMSNorm",
        layernorm_epsilon=c.get("layer_norm_epsilon", 1e-5),
        add_bias_linear=False,
        position_embedding_type="none",
        untie_embeddings_and_output_weights=not c.get("tie_word_embeddings", False),
        init_method_std=c.get("initializer_range", 0.02),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        extra={"hf_model_type": "mamba2"},
    )
    return MambaConfig(**{**fields, **overrides})


def mamba2_config_to_hf(config: MambaConfig) -> dict[str, Any]:
    """`MambaConfig` → a `Mamba2ForCausalLM` config.json dict; a hybrid (attention or
    MLP layers) or a non-RMSNorm model is refused: Mamba2ForCausalLM has neither."""
    c = config
    if set(c.layer_pattern) != {"M"}:
        raise ValueError(
            f"Mamba2ForCausalLM has Mamba layers only; this model's pattern is {c.layer_pattern!r}"
        )
    if c.normalization != "RMSNorm" or c.add_bias_linear:
        raise ValueError("Mamba2ForCausalLM needs RMSNorm and no linear biases")
    if c.position_embedding_type != "none":
        raise ValueError("Mamba2ForCausalLM has no position embeddings")
    if c.mamba_d_inner % c.hidden_size:
        raise ValueError(
            f"Mamba2ForCausalLM needs d_inner (mamba_num_heads · mamba_head_dim = "
            f"{c.mamba_d_inner}) to be a multiple of hidden_size ({c.hidden_size})"
        )
    return dict(
        architectures=[MAMBA2.hf_class],
        model_type="mamba2",
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        num_hidden_layers=c.num_layers,
        num_heads=c.mamba_num_heads,
        head_dim=c.mamba_head_dim,
        expand=c.mamba_d_inner // c.hidden_size,
        state_size=c.mamba_state_dim,
        n_groups=c.mamba_num_groups,
        conv_kernel=c.mamba_conv_kernel,
        chunk_size=c.mamba_chunk_size,
        layer_norm_epsilon=c.layernorm_epsilon,
        use_bias=False,
        use_conv_bias=True,
        hidden_act="silu",
        residual_in_fp32=True,
        tie_word_embeddings=not c.untie_embeddings_and_output_weights,
        initializer_range=c.init_method_std,
    )


# Nemotron-H -----------------------------------------------------------------------

NEMOTRON_H_TYPE = "nemotron_h"
NEMOTRON_H_CLASS = "NemotronHForCausalLM"

_BLOCK_TYPES = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}
_MLP_ACTIVATIONS = {"relu2": "squared_relu", "relu": "relu", "gelu": "gelu"}

# Per layer letter: (our name, its HF tensors under backbone.layers.{i}., layout).
_NEMOTRON_H_LAYERS: dict[str, tuple[tuple[str, tuple[str, ...], str], ...]] = {
    "M": (
        ("norm.weight", ("norm.weight",), "copy"),
        *((f"mixer.{t}", (f"mixer.{t}",), "copy") for t in _MIXER_TENSORS),
    ),
    "*": (
        ("input_layernorm.weight", ("norm.weight",), "copy"),
        (
            "self_attention.linear_qkv.weight",
            ("mixer.q_proj.weight", "mixer.k_proj.weight", "mixer.v_proj.weight"),
            "qkv",
        ),
        ("self_attention.linear_proj.weight", ("mixer.o_proj.weight",), "copy"),
    ),
    "-": (
        ("pre_mlp_layernorm.weight", ("norm.weight",), "copy"),
        ("mlp.linear_fc1.weight", ("mixer.up_proj.weight",), "copy"),
        ("mlp.linear_fc2.weight", ("mixer.down_proj.weight",), "copy"),
    ),
}


def nemotron_h_architecture(layer_pattern: str) -> HFArchitecture:
    """The weight table of a NemotronHForCausalLM with this pattern, one rule per
    layer tensor (the names depend on each layer's letter, not only on its index).
    Files are keyed `backbone.` (what `save_pretrained` writes and the Hub holds)."""
    rules = [WeightRule("embedding.word_embeddings.weight", ("backbone.embeddings.weight",))]
    for i, letter in enumerate(layer_pattern):
        if letter not in _NEMOTRON_H_LAYERS:
            raise ValueError(f"NemotronH layer {i} is {letter!r}: only M, * and - are supported")
        rules += [
            WeightRule(
                f"decoder.layers.{i}.{ours}",
                tuple(f"backbone.layers.{i}.{t}" for t in theirs),
                layout,
            )
            for ours, theirs, layout in _NEMOTRON_H_LAYERS[letter]
        ]
    rules += [
        WeightRule("decoder.final_norm.weight", ("backbone.norm_f.weight",)),
        WeightRule("output_layer.weight", ("lm_head.weight",)),
    ]
    return HFArchitecture(
        model_type=NEMOTRON_H_TYPE,
        hf_class=NEMOTRON_H_CLASS,
        base_model_prefix="backbone.",
        rules=tuple(rules),
    )


def _nemotron_h_pattern(c: dict[str, Any]) -> str:
    """Megatron's pattern string from `layers_block_type` (transformers ≥ 5) or the
    older `hybrid_override_pattern`."""
    blocks = c.get("layers_block_type") or c.get("layer_types")
    if blocks:
        unknown = sorted(set(blocks) - set(_BLOCK_TYPES))
        if unknown:
            raise ValueError(f"NemotronH layers_block_type has unknown types {unknown}")
        pattern = "".join(_BLOCK_TYPES[b] for b in blocks)
    else:
        pattern = c.get("hybrid_override_pattern") or ""
    if not pattern:
        raise ValueError(
            "NemotronH config has neither layers_block_type nor hybrid_override_pattern"
        )
    if "E" in pattern:
        raise ValueError(
            "NemotronH 'moe' layers (E in the pattern) are not supported: "
            "MambaModel has no MoE layer yet"
        )
    return pattern


def nemotron_h_config_from_hf(hf_config: Any, **overrides: Any) -> MambaConfig:
    """A `NemotronHConfig` (or its config.json dict) → `MambaConfig`.

    Refused by name: MoE layers, biases (use_bias, mlp_bias), no conv bias, a Mamba
    activation other than silu, an MLP activation we lack, tie_word_embeddings
    (transformers' NemotronH never ties lm_head), multi-token-prediction layers.
    Taken as transformers uses them: `head_dim` for attention (scale head_dim^-0.5),
    one `layer_norm_epsilon` for every norm including the Mamba gated norm (group
    size d_inner / n_groups, as ours), dt clamped below at `time_step_min` (its
    `time_step_limit` is not read by the model). residual_in_fp32, attention_bias
    and sliding_window are not read by transformers' NemotronH either, so not here."""
    c = _as_dict(hf_config)

    def refuse(name: str, why: str) -> None:
        raise ValueError(f"NemotronH {name}={c.get(name)!r} is not supported: {why}")

    pattern = _nemotron_h_pattern(c)
    if c.get("use_bias", False):
        refuse("use_bias", "Megatron's MambaMixer has no projection biases")
    if c.get("mlp_bias", False):
        refuse("mlp_bias", "MambaModel's MLP layers have no biases")
    if not c.get("use_conv_bias", True):
        refuse("use_conv_bias", "the Mamba conv1d has a bias")
    if c.get("mamba_hidden_act", "silu") != "silu":
        refuse("mamba_hidden_act", "the Mamba mixer uses silu")
    mlp_act = c.get("mlp_hidden_act", "relu2")
    if mlp_act not in _MLP_ACTIVATIONS:
        refuse("mlp_hidden_act", f"known: {', '.join(_MLP_ACTIVATIONS)}")
    if c.get("tie_word_embeddings", False):
        refuse("tie_word_embeddings", "transformers' NemotronH keeps lm_head apart")
    if c.get("num_nextn_predict_layers") or 0:
        refuse("num_nextn_predict_layers", "MambaModel has no multi-token prediction")
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    head_dim = c.get("head_dim") or c.get("attention_head_dim") or hidden // heads
    max_positions = c.get("max_position_embeddings") or 4096
    fields: dict[str, Any] = dict(
        num_layers=len(pattern),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=c.get("num_key_value_heads") or heads,
        kv_channels=head_dim,
        ffn_hidden_size=c["intermediate_size"],
        activation=_MLP_ACTIVATIONS[mlp_act],
        vocab_size=c["vocab_size"],
        seq_length=min(1024, max_positions),
        max_position_embeddings=max_positions,
        hybrid_override_pattern=pattern,
        mamba_num_heads=c["mamba_num_heads"],
        mamba_head_dim=c["mamba_head_dim"],
        mamba_state_dim=c["ssm_state_size"],
        mamba_num_groups=c.get("n_groups", c.get("mamba_n_groups", 8)),
        mamba_conv_kernel=c.get("conv_kernel", c.get("mamba_d_conv", 4)),
        mamba_chunk_size=c.get("chunk_size", c.get("mamba_chunk_size", 128)),
        mamba_dt_clamp_min=float(c.get("time_step_min", c.get("mamba_dt_min", 0.001))),
        normalization="RMSNorm",
        layernorm_epsilon=c.get("layer_norm_epsilon", 1e-5),
        add_bias_linear=False,
        position_embedding_type="none",
        untie_embeddings_and_output_weights=True,
        init_method_std=c.get("initializer_range", 0.02),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        extra={"hf_model_type": NEMOTRON_H_TYPE},
    )
    return MambaConfig(**{**fields, **overrides})


def nemotron_h_config_to_hf(config: MambaConfig) -> dict[str, Any]:
    """`MambaConfig` → a `NemotronHForCausalLM` config.json dict; what NemotronH cannot
    express (norms other than RMSNorm, biases, positional embeddings, a gated or
    unknown MLP activation, tied embeddings, QK norms, sliding windows, 1p norms,
    MoE) is refused by name."""
    c = config

    def refuse(name: str, why: str) -> None:
        raise ValueError(f"{name}={getattr(c, name)!r}: NemotronHForCausalLM {why}")

    if c.normalization != "RMSNorm":
        refuse("normalization", "has RMSNorm only")
    if c.add_bias_linear or c.add_qkv_bias:
        refuse("add_bias_linear" if c.add_bias_linear else "add_qkv_bias", "has no biases")
    if c.position_embedding_type != "none":
        refuse("position_embedding_type", "has no positional embeddings")
    activations = {ours: theirs for theirs, ours in _MLP_ACTIVATIONS.items()}
    if c.activation not in activations:
        refuse("activation", f"has non-gated {', '.join(activations)} MLPs only")
    if not c.untie_embeddings_and_output_weights:
        refuse("untie_embeddings_and_output_weights", "never ties lm_head to the embeddings")
    if c.qk_layernorm:
        refuse("qk_layernorm", "has no query/key norms")
    if c.window_size is not None:
        refuse("window_size", "has full attention only")
    if c.layernorm_zero_centered_gamma:
        refuse("layernorm_zero_centered_gamma", "norms multiply by the weight itself")
    if c.num_moe_experts is not None:
        refuse("num_moe_experts", "MoE layers are not exported yet")
    letters = {letter: block for block, letter in _BLOCK_TYPES.items()}
    return dict(
        architectures=[NEMOTRON_H_CLASS],
        model_type=NEMOTRON_H_TYPE,
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        layers_block_type=[letters[letter] for letter in c.layer_pattern],
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_query_groups,
        head_dim=c.kv_channels,
        attention_bias=False,
        intermediate_size=c.ffn_hidden_size,
        mlp_hidden_act=activations[c.activation],
        mlp_bias=False,
        mamba_num_heads=c.mamba_num_heads,
        mamba_head_dim=c.mamba_head_dim,
        ssm_state_size=c.mamba_state_dim,
        n_groups=c.mamba_num_groups,
        conv_kernel=c.mamba_conv_kernel,
        chunk_size=c.mamba_chunk_size,
        mamba_hidden_act="silu",
        use_conv_bias=True,
        use_bias=False,
        # transformers clamps dt at time_step_min; 0 (a Megatron-trained model) is no clamp
        time_step_min=c.mamba_dt_clamp_min,
        layer_norm_epsilon=c.layernorm_epsilon,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=False,
        num_nextn_predict_layers=0,
        initializer_range=c.init_method_std,
    )
