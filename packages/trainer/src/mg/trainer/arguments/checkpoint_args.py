"""Megatron's `--use-checkpoint-args`: take the model (and tokenizer) from `--load`.

With `--load DIR --use-checkpoint-args` the model's `TransformerConfig` is the one
the checkpoint records in `state["mg"]["model_config"]`, taken whole, so settings
no mg-train flag expresses (activation ``gelu_tanh``, ``rope_scaling``,
``window_size``, the padded vocabulary size ...) survive a fine-tune.

Only these training-time knobs are taken from the command line when given there
(they change how the model trains, not the weights it loads):

- ``--seq-length`` (the training sequence length; it must fit
  ``max_position_embeddings`` for learned absolute positions),
- ``--attention-dropout``, ``--hidden-dropout``,
- ``--init-method-std`` (irrelevant when weights are loaded, but recorded),
- the recompute flags (``--recompute-*``), which are not part of the config.

Model-shape flags (``--num-layers``, ``--hidden-size`` ...) may be repeated on
the command line, but must agree with the checkpoint. The tokenizer comes from the
checkpoint's ``tokenizer_config`` (relative paths resolved against ``--load``)
unless a tokenizer flag is given.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mg.trainer.arguments.errors import ArgumentError

if TYPE_CHECKING:
    from mg.trainer.arguments.args import Args

# Training-time knobs: a value given on the command line replaces the checkpoint's.
TRAINING_KNOBS = {
    "seq_length": "seq_length",
    "attention_dropout": "attention_dropout",
    "hidden_dropout": "hidden_dropout",
    "init_method_std": "init_method_std",
}

# ModelArgs field -> how to read it from a TransformerConfig.
_SHAPE: dict[str, Any] = {
    "num_layers": lambda c: c.num_layers,
    "hidden_size": lambda c: c.hidden_size,
    "ffn_hidden_size": lambda c: c.ffn_hidden_size,
    "num_attention_heads": lambda c: c.num_attention_heads,
    "group_query_attention": lambda c: c.num_query_groups != c.num_attention_heads,
    "num_query_groups": lambda c: c.num_query_groups,
    "kv_channels": lambda c: c.kv_channels,
    "max_position_embeddings": lambda c: c.max_position_embeddings,
    "position_embedding_type": lambda c: c.position_embedding_type,
    "rotary_base": lambda c: c.rotary_base,
    "rotary_percent": lambda c: c.rotary_percent,
    "normalization": lambda c: c.normalization,
    "norm_epsilon": lambda c: c.layernorm_epsilon,
    "apply_layernorm_1p": lambda c: c.layernorm_zero_centered_gamma,
    "swiglu": lambda c: c.activation == "swiglu",
    "disable_bias_linear": lambda c: not c.add_bias_linear,
    "add_qkv_bias": lambda c: c.add_qkv_bias,
    "qk_layernorm": lambda c: c.qk_layernorm,
    "untie_embeddings_and_output_weights": lambda c: c.untie_embeddings_and_output_weights,
}

TOKENIZER_FLAGS = (
    "tokenizer_type",
    "vocab_file",
    "merge_file",
    "tokenizer_model",
    "vocab_size",
    "vocab_extra_ids",
)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def apply_checkpoint_args(args: Args, given: set[str]) -> None:
    """Fill `args` from the checkpoint in `--load`; `given` names the flags set explicitly.

    Raises `ArgumentError` when the checkpoint records no model config or when a
    model-shape flag disagrees with it.
    """
    # lazy: --help stays instant (the parser imports this module; mg.core.checkpoint and
    # mg.core.models import torch, mg.core.tokenizers the tokenizer libraries)
    from mg.core.checkpoint import CheckpointError, describe, resolve_tokenizer_paths
    from mg.core.models import TransformerConfig
    from mg.core.tokenizers import TokenizerConfig

    load = args.checkpoint.load
    if not load:
        raise ArgumentError("--use-checkpoint-args needs --load (the checkpoint to read)")
    if not Path(load).exists():  # a first run: Megatron uses the flags it was given
        if args.checkpoint.exit_on_missing_checkpoint:  # ... or exits, with this flag
            raise ArgumentError(
                f"--use-checkpoint-args: no checkpoint in {load} to read the model from, and "
                "--exit-on-missing-checkpoint; convert or train one into --load first"
            )
        print(
            f"--use-checkpoint-args: no checkpoint in {load} yet; using the flags", file=sys.stderr
        )
        return
    try:
        info = describe(load)
    except (CheckpointError, FileNotFoundError, OSError) as exc:
        raise ArgumentError(
            f"--use-checkpoint-args: cannot read a checkpoint in {load}: {exc}"
        ) from None
    if not info.model_config:
        raise ArgumentError(
            f"--use-checkpoint-args: {info.path} records no model config (no state['mg'] "
            "metadata; not written by mg tools). Pass the model flags instead (--num-layers, "
            "--hidden-size, --num-attention-heads, --seq-length ...) and drop "
            "--use-checkpoint-args, or import a Megatron-LM checkpoint with "
            "`mg-convert import-megatron` first."
        )
    data = dict(info.model_config)
    # the shape flags are TransformerConfig's; a family's own fields (Retro's encoder and
    # chunks, ...) stay in `data` for that family's config (e.g. RetroConfig.from_dict)
    shared = {f.name for f in dataclasses.fields(TransformerConfig)}
    config = TransformerConfig.from_dict({k: v for k, v in data.items() if k in shared})
    m = args.model
    for name, read in _SHAPE.items():
        saved = read(config)
        if name in given and getattr(m, name) != saved:
            raise ArgumentError(
                f"{_flag(name)} {getattr(m, name)} disagrees with the checkpoint in {load} "
                f"({saved}); drop {_flag(name)} to use the checkpoint's value, or drop "
                "--use-checkpoint-args"
            )
        setattr(m, name, saved)
    for name, key in TRAINING_KNOBS.items():
        if name in given:
            data[key] = getattr(m, name)
        else:
            setattr(m, name, data.get(key, getattr(config, key)))
    args.checkpoint_model_config = data

    d = args.data
    from_checkpoint = args.checkpoint.use_tokenizer_model_from_checkpoint_args
    if (
        from_checkpoint
        and not any(name in given for name in TOKENIZER_FLAGS)
        and info.tokenizer_config
    ):
        tokenizer = resolve_tokenizer_paths(
            TokenizerConfig.from_dict(dict(info.tokenizer_config)), load
        )
        for name in TOKENIZER_FLAGS:
            setattr(d, name, getattr(tokenizer, name))
        args.checkpoint_tokenizer_config = tokenizer
