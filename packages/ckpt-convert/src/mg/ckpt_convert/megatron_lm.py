"""`mg-convert import-megatron` / `export-megatron`: Megatron-LM `torch`-format GPT checkpoints.

The weights already have Megatron-Core names (our GPTModel uses them), so the
work is the config: Megatron-LM records its flags as an `argparse.Namespace`
under ``args``; we read the model-shaping ones into a `TransformerConfig` and,
on export, write a Namespace back with the same names (and
``transformer_impl="local"``, whose layer spec names match ours).

Checkpoints written with the Transformer Engine spec fuse the norms into the
next linear layer (`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`);
import renames those to the local spec's `input_layernorm` / `pre_mlp_layernorm`.

TP=1 and PP=1 only for now. The Namespace needs pickle to load, so only
convert checkpoints you trust.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import Tensor

from mg.ckpt_convert.errors import ConvertError
from mg.ckpt_convert.import_hf import expected_shapes
from mg.ckpt_convert.staging import check_target, staged_dir
from mg.core.checkpoint import (
    CHECKPOINT_VERSION,
    load_checkpoint,
    mg_metadata,
    save_checkpoint_shards,
)
from mg.core.checkpoint.model_io import load_model, save_model
from mg.core.models import ConfigError, RopeScaling, TransformerConfig
from mg.core.tokenizers.config import TokenizerConfig

# Transformer Engine spec name → local spec name (suffix replacements).
_TE_RENAMES = (
    (".self_attention.linear_qkv.layer_norm_weight", ".input_layernorm.weight"),
    (".self_attention.linear_qkv.layer_norm_bias", ".input_layernorm.bias"),
    (".mlp.linear_fc1.layer_norm_weight", ".pre_mlp_layernorm.weight"),
    (".mlp.linear_fc1.layer_norm_bias", ".pre_mlp_layernorm.bias"),
)
_PLAIN = (str, int, float, bool, type(None))


def config_from_megatron_args(args: Mapping[str, Any]) -> TransformerConfig:
    """Megatron-LM's parsed flags → TransformerConfig (the fields that shape the model)."""

    def get(name: str, default: Any = None) -> Any:
        value = args.get(name, default)
        return default if value is None else value

    if get("num_experts"):
        raise ConvertError("MoE checkpoints (--num-experts) are not supported yet")
    if get("swiglu", False):
        activation = "swiglu"
    elif get("squared_relu", False):
        activation = "squared_relu"
    elif get("openai_gelu", False):
        activation = "gelu_tanh"
    else:
        activation = "gelu"
    position = get("position_embedding_type", "learned_absolute")
    rope_scaling = None
    if get("use_rope_scaling", False):
        rope_scaling = RopeScaling(factor=float(get("rope_scaling_factor", 8.0)))
    window = get("window_size")
    try:
        return TransformerConfig(
            num_layers=args["num_layers"],
            hidden_size=args["hidden_size"],
            num_attention_heads=args["num_attention_heads"],
            vocab_size=args["padded_vocab_size"],
            ffn_hidden_size=get("ffn_hidden_size"),
            num_query_groups=get("num_query_groups") if get("group_query_attention") else None,
            kv_channels=get("kv_channels"),
            seq_length=get("seq_length", 1024),
            max_position_embeddings=get("max_position_embeddings"),
            position_embedding_type=position,
            rotary_base=float(get("rotary_base", 10000)),
            rotary_percent=float(get("rotary_percent", 1.0)),
            rope_scaling=rope_scaling if position == "rope" else None,
            normalization=get("normalization", "LayerNorm"),
            layernorm_epsilon=float(get("norm_epsilon", get("layernorm_epsilon", 1e-5))),
            activation=activation,
            add_bias_linear=bool(get("add_bias_linear", True)),
            add_qkv_bias=bool(get("add_qkv_bias", False)),
            untie_embeddings_and_output_weights=bool(
                get("untie_embeddings_and_output_weights", False)
            ),
            window_size=tuple(window) if window else None,
            init_method_std=float(get("init_method_std", 0.02)),
            attention_dropout=float(get("attention_dropout", 0.1)),
            hidden_dropout=float(get("hidden_dropout", 0.1)),
        )
    except KeyError as exc:
        raise ConvertError(f"Megatron-LM args lack {exc.args[0]!r}") from None
    except ConfigError as exc:
        raise ConvertError(f"Megatron-LM args describe an unsupported model: {exc}") from None


def megatron_args_from_config(
    config: TransformerConfig, tokenizer: TokenizerConfig | None
) -> argparse.Namespace:
    """The inverse: the Namespace Megatron-LM's `load_checkpoint` and `convert.py` read."""
    c = config
    args = argparse.Namespace(
        num_layers=c.num_layers,
        hidden_size=c.hidden_size,
        ffn_hidden_size=c.ffn_hidden_size,
        num_attention_heads=c.num_attention_heads,
        group_query_attention=c.num_query_groups != c.num_attention_heads,
        num_query_groups=c.num_query_groups,
        kv_channels=c.kv_channels,
        seq_length=c.seq_length,
        max_position_embeddings=c.max_position_embeddings,
        position_embedding_type=c.position_embedding_type,
        rotary_base=int(c.rotary_base),
        rotary_percent=c.rotary_percent,
        use_rope_scaling=c.rope_scaling is not None,
        rope_scaling_factor=c.rope_scaling.factor if c.rope_scaling else 8.0,
        normalization=c.normalization,
        norm_epsilon=c.layernorm_epsilon,
        swiglu=c.activation == "swiglu",
        squared_relu=c.activation == "squared_relu",
        openai_gelu=c.activation == "gelu_tanh",
        add_bias_linear=c.add_bias_linear,
        add_qkv_bias=c.add_qkv_bias or c.add_bias_linear,
        untie_embeddings_and_output_weights=c.untie_embeddings_and_output_weights,
        padded_vocab_size=c.vocab_size,
        window_size=list(c.window_size) if c.window_size else None,
        init_method_std=c.init_method_std,
        attention_dropout=c.attention_dropout,
        hidden_dropout=c.hidden_dropout,
        num_experts=None,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        expert_model_parallel_size=1,
        transformer_impl="local",
        model_type="GPT",
    )
    if tokenizer is not None:
        for key, value in tokenizer.to_dict().items():
            setattr(args, key, value)
    return args


def local_spec_weights(model: Mapping[str, Any]) -> dict[str, Tensor]:
    """Drop `_extra_state`, rename TE-fused norm names to the local spec's."""
    out = {}
    for name, tensor in model.items():
        if name.endswith("_extra_state") or tensor is None:
            continue
        for te, local in _TE_RENAMES:
            if name.endswith(te):
                name = name[: -len(te)] + local
        out[name] = tensor
    return out


def import_megatron(load: str | Path, save: str | Path, iteration: int | str | None = None) -> Path:
    """Megatron-LM checkpoint (TP=1, PP=1) → mg checkpoint with the same iteration."""
    check_target(save)
    state, iteration = load_checkpoint(load, iteration, pp_size=None, allow_pickle=True)
    raw_args = state.get("args")
    if raw_args is None:
        raise ConvertError(f"{load}: the checkpoint has no 'args'; not written by Megatron-LM")
    args = vars(raw_args) if isinstance(raw_args, argparse.Namespace) else dict(raw_args)
    tp, pp = args.get("tensor_model_parallel_size", 1), args.get("pipeline_model_parallel_size", 1)
    if tp != 1 or pp != 1:
        raise ConvertError(
            f"{load}: saved with TP={tp} PP={pp}; import-megatron reads TP=1 PP=1 (merge it "
            "with Megatron-LM's tools/checkpoint/convert.py --target-tensor-parallel-size 1 "
            "--target-pipeline-parallel-size 1 first)"
        )
    config = config_from_megatron_args(args)
    model = state.get("model")
    if model is None:
        raise ConvertError(f"{load}: the checkpoint has no 'model' entry")
    weights = local_spec_weights(model)
    if not config.untie_embeddings_and_output_weights:
        weights.pop("output_layer.weight", None)  # a tied copy, when saved at all
    shapes = expected_shapes(config)
    unknown = sorted(set(weights) - set(shapes))
    missing = sorted(set(shapes) - set(weights))
    if unknown or missing:
        raise ConvertError(
            f"{load}: the weights do not fit the model its args describe; "
            f"unexpected {unknown[:6]}, missing {missing[:6]}"
        )
    for name, tensor in weights.items():
        if tensor.shape != shapes[name]:
            raise ConvertError(
                f"{load}: shape mismatch for {name}: {tuple(tensor.shape)} in the checkpoint, "
                f"{tuple(shapes[name])} from its args"
            )
    tokenizer = None
    if args.get("tokenizer_type"):
        tokenizer = TokenizerConfig.from_dict(args)
    plain_args = {k: v for k, v in args.items() if isinstance(v, _PLAIN)}
    plain_args["converted_by"] = "mg-convert import-megatron"
    with staged_dir(save) as staging:
        save_model(staging, weights, config, tokenizer, iteration=iteration, args=plain_args)
    return Path(save)


def export_megatron(load: str | Path, save: str | Path, iteration: int | str | None = None) -> Path:
    """mg checkpoint → Megatron-LM checkpoint (local layer spec names, TP=1, PP=1)."""
    check_target(save)
    model, config, tokenizer, info = load_model(load, iteration)
    state = {
        "model": model.state_dict(),
        "args": megatron_args_from_config(config, tokenizer),
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": info.iteration if isinstance(info.iteration, int) else 0,
        "mg": mg_metadata(config.to_dict(), tokenizer.to_dict() if tokenizer else None),
    }
    with staged_dir(save) as staging:
        save_checkpoint_shards(staging, info.iteration, {(0, 0): state})
    return Path(save)
