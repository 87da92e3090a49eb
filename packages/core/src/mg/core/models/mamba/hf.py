"""Hugging Face `Mamba2ForCausalLM` ↔ our `MambaModel` (all layers Mamba): names and config.

The weights need no layout change: transformers' `Mamba2Mixer` uses the same
parameter names and the same in_proj row order (z, x, B, C, dt) as
megatron-core's `MambaMixer`, so the table below is renames only, in the form
`hf_mapping` interprets (`hf_to_megatron` / `megatron_to_hf` with `MAMBA2`),
and a round trip is bit-exact.
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
