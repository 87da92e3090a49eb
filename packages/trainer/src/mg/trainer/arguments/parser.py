"""The `mg-train` parser: Megatron's flag groups, a YAML config under them, then validation.

Each group's file defines its flags, its dataclass and its checks; this module
only assembles them, fills derived values (`finalize`) and runs the checks in
order (`validate`), so the first message a user sees is the most basic problem.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import fields
from typing import Any

import yaml

from mg.core.help_format import DefaultsHelpFormatter
from mg.trainer.arguments import (
    checkpoint_args,
    checkpointing,
    combinations,
    data,
    fsdp,
    gpt_oss,
    ict,
    layer_variants,
    learning_rate,
    logging,
    mamba,
    mla,
    model,
    moe,
    mtp,
    parallel,
    retro,
    sft,
    training,
    transformer_engine,
    vlm,
)
from mg.trainer.arguments.args import GROUPS, Args
from mg.trainer.arguments.errors import ArgumentError, fail

FAMILIES = ("gpt", "bert", "t5", "mamba", "vlm", "retro", "ict")

# Help-section title -> the function that adds that group's flags (Megatron's order).
FLAG_GROUPS = (
    ("model", model.add_model_flags),
    ("layer variants: sliding window, Gemma 3", layer_variants.add_layer_variant_flags),
    ("gpt-oss: attention sinks, clamped SwiGLU, its kernel flags", gpt_oss.add_gpt_oss_flags),
    ("multi-latent attention and YaRN RoPE", mla.add_mla_flags),
    ("transformer engine and attention kernels", transformer_engine.add_transformer_engine_flags),
    ("data and tokenizer", data.add_data_flags),
    ("supervised finetuning (chat data)", sft.add_sft_flags),
    ("training", training.add_training_flags),
    ("optimizer and learning rate", learning_rate.add_learning_rate_flags),
    ("checkpointing", checkpointing.add_checkpointing_flags),
    ("logging", logging.add_logging_flags),
    ("distributed", parallel.add_parallel_flags),
    ("fully sharded data parallel", fsdp.add_fsdp_flags),
    ("mamba and hybrid models (mg-train mamba)", mamba.add_mamba_flags),
    ("mixture of experts", moe.add_moe_flags),
    ("multi-token prediction (DeepSeek-V3)", mtp.add_mtp_flags),
    ("retrieval: Retro (mg-train retro)", retro.add_retro_flags),
    ("vision-language models (mg-train vlm)", vlm.add_vlm_flags),
    ("biencoder: REALM's Inverse Cloze Task (mg-train ict)", ict.add_ict_flags),
)


def build_parser() -> argparse.ArgumentParser:
    """The `mg-train` parser: a model family, then Megatron's flags."""
    parser = argparse.ArgumentParser(
        prog="mg-train",
        description="Pretrain a GPT, BERT, T5 or Mamba/hybrid model with Megatron-LM's flags. "
        "Run under torchrun for data parallelism.",
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("family", choices=FAMILIES, help="Model family to train.")
    parser.add_argument(
        "--config",
        help="YAML file whose keys are flag names (hidden_size or hidden-size); flags override it.",
    )
    for title, adder in FLAG_GROUPS:
        adder(parser.add_argument_group(title))
    return parser


def _load_yaml_defaults(path: str, parser: argparse.ArgumentParser) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise ArgumentError(f"--config {path}: file not found")
    with open(path, encoding="utf-8") as stream:
        try:
            content = yaml.safe_load(stream) or {}
        except yaml.YAMLError as error:
            raise ArgumentError(f"--config {path}: not valid YAML: {error}") from error
    if not isinstance(content, dict):
        raise ArgumentError(f"--config {path}: expected a mapping of flag names to values")
    known = {action.dest for action in parser._actions}
    out: dict[str, Any] = {}
    for key, value in content.items():
        dest = str(key).lstrip("-").replace("-", "_")
        if dest not in known or dest in ("help", "config", "family"):
            raise ArgumentError(
                f"--config {path}: unknown key {key!r}; keys are mg-train flag names "
                "(see mg-train gpt --help)"
            )
        out[dest] = value
    return out


def parse_args(argv: list[str] | None = None, world_size: int = 1) -> Args:
    """Parse (YAML config, then the command line) into `Args`, validated."""
    parser = build_parser()
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    if known.config:
        parser.set_defaults(**_load_yaml_defaults(known.config, parser))
    namespace = parser.parse_args(argv)
    values = vars(namespace)
    given = _given_flags(argv, known.config, parser)
    args = Args(family=values["family"])
    for group, cls in GROUPS.items():
        kwargs = {f.name: values[f.name] for f in fields(cls) if f.name not in parallel.NOT_FLAGS}
        setattr(args, group, cls(**kwargs))
    args.distributed.world_size = world_size
    if args.checkpoint.use_checkpoint_args:
        checkpoint_args.apply_checkpoint_args(args, given)
    finalize(args)
    validate(args)
    return args


def _given_flags(
    argv: list[str] | None, config: str | None, parser: argparse.ArgumentParser
) -> set[str]:
    """Destinations set explicitly, on the command line or in the YAML config."""
    bare = build_parser()
    for action in bare._actions:
        if action.dest != "help":
            action.default = argparse.SUPPRESS
    given = set(vars(bare.parse_args(argv)))
    if config:
        given |= set(_load_yaml_defaults(config, parser))
    return given


def finalize(args: Args) -> None:
    """Fill the values Megatron derives from others (GBS default, recompute shortcut)."""
    model.finalize_model(args)
    transformer_engine.finalize_transformer_engine(args)
    parallel.finalize_parallel(args)
    fsdp.finalize_fsdp(args)
    retro.finalize_retro(args)
    training.finalize_training(args)
    data.finalize_data(args)


def _require(args: Args) -> None:
    """The flags every run needs, named together (argparse's "required" wording)."""
    missing = [
        f"--{name.replace('_', '-')}"
        for group, names in (
            ("model", model.REQUIRED),
            ("training", training.REQUIRED),
            ("optimizer", learning_rate.REQUIRED),
        )
        for name in names
        if getattr(getattr(args, group), name) is None
    ]
    if missing:
        hint = ""
        if args.checkpoint.load and not args.checkpoint.use_checkpoint_args:
            hint = (
                f"; to take the model shape from the checkpoint in {args.checkpoint.load}, "
                "add --use-checkpoint-args"
            )
        fail(f"missing required arguments: {', '.join(missing)}{hint}")
    training.check_training_length(args)


def validate(args: Args) -> None:
    """Refuse inconsistent flags before anything heavy starts (Megatron's validate_args)."""
    _require(args)
    combinations.check_combinations(args)  # the pairs of flags that do not go together
    mamba.check_mamba(args)
    moe.check_moe(args)
    mtp.check_mtp(args)
    retro.check_retro(args)
    vlm.check_vlm(args)
    ict.check_ict(args)
    layer_variants.check_layer_variants(args)
    gpt_oss.check_gpt_oss(args)
    mla.check_mla(args)
    if args.training.dry_run:
        parallel.check_dry_run_layout(args)
    else:
        parallel.check_tensor_parallel(args)
        parallel.check_pipeline_and_context(args)
        training.check_fusion_and_compile(args)
    transformer_engine.check_transformer_engine(args)
    parallel.check_distributed_optimizer(args)
    fsdp.check_fsdp(args)
    checkpointing.check_initialization(args)
    model.check_model(args)
    training.check_training(args)
    learning_rate.check_learning_rate(args)
    logging.check_logging(args)
    checkpointing.check_checkpointing(args)
    data.check_data(args)
    sft.check_sft(args)
