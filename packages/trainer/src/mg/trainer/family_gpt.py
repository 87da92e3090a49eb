"""The GPT family: Megatron's GPT flags onto `TransformerConfig`, the model, its datasets
(mock, `--data-path` or a blend file) and its loss.

The Mamba/hybrid family reuses the config and datasets; BERT and T5 the config's
shared fields.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from mg.core.models import GPTModel, TransformerConfig
from mg.core.models.config import RopeScaling
from mg.core.models.mtp import MTPLosses
from mg.indexed_dataset import (
    GPTDatasetConfig,
    build_gpt_datasets,
    build_mock_gpt_datasets,
    read_blend_file,
)
from mg.trainer.arguments import Args
from mg.trainer.arguments.gpt_oss import gpt_oss_config
from mg.trainer.arguments.layer_variants import activation_of, layer_variant_config_fields
from mg.trainer.arguments.mla import mla_config_fields
from mg.trainer.arguments.moe import moe_config_fields
from mg.trainer.arguments.mtp import mtp_config_fields, mtp_loss_names
from mg.trainer.model_parallel import PipelineSteps
from mg.trainer.sft_data import sft_datasets


def gpt_config(args: Args, vocab_size: int):
    """Megatron's GPT flags onto `TransformerConfig`."""
    if args.checkpoint_model_config is not None:
        # --use-checkpoint-args: the checkpoint's config, whole (see arguments/checkpoint_args.py),
        # but this run's attention kernel (it does not change the weights)
        recorded = dict(args.checkpoint_model_config)
        recorded["attention_backend"] = args.transformer_engine.attention_backend
        return TransformerConfig.from_dict(recorded)
    m = args.model
    activation = activation_of(m.swiglu, args.layer_variants)
    config = TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        vocab_size=vocab_size,
        ffn_hidden_size=m.ffn_hidden_size,
        num_query_groups=m.num_query_groups if m.group_query_attention else None,
        kv_channels=m.kv_channels,
        seq_length=m.seq_length,
        max_position_embeddings=m.max_position_embeddings,
        position_embedding_type=m.position_embedding_type,
        rotary_base=m.rotary_base,
        rotary_percent=m.rotary_percent,
        rope_scaling=RopeScaling(factor=m.rope_scaling_factor) if m.use_rope_scaling else None,
        normalization=m.normalization,
        layernorm_epsilon=m.norm_epsilon,
        layernorm_zero_centered_gamma=m.apply_layernorm_1p,
        activation=activation,
        add_bias_linear=not m.disable_bias_linear,
        add_qkv_bias=m.add_qkv_bias,
        qk_layernorm=m.qk_layernorm,
        untie_embeddings_and_output_weights=m.untie_embeddings_and_output_weights,
        init_method_std=m.init_method_std,
        attention_dropout=m.attention_dropout,
        hidden_dropout=m.hidden_dropout,
        attention_backend=args.transformer_engine.attention_backend,
        transformer_impl=args.transformer_engine.transformer_impl,
        **moe_config_fields(args.moe),
        **layer_variant_config_fields(args.layer_variants),
        **mla_config_fields(args.mla),
        **mtp_config_fields(args.mtp),
    )
    return gpt_oss_config(config, args.gpt_oss)


def gpt_model(config, args: Args | None = None) -> nn.Module:
    return GPTModel(config)


def gpt_datasets(args: Args, tokenizer: Any, num_samples: Sequence[int]):
    """Megatron's GPT datasets: mock, `--data-path` words or a blend file; with --sft,
    packed conversations (sft_data.py)."""
    if args.sft.sft:
        return sft_datasets(args, num_samples)
    d = args.data
    config = GPTDatasetConfig(
        seq_length=args.model.seq_length,
        seed=args.training.seed,
        split=d.split or "969, 30, 1",
        path_to_cache=d.data_cache_path,
        eod_token_id=tokenizer.eod,
        pad_token_id=tokenizer.pad,
        reset_position_ids=d.reset_position_ids,
        reset_attention_mask=d.reset_attention_mask,
        eod_mask_loss=d.eod_mask_loss,
        create_attention_mask=d.reset_attention_mask,
        mmap_bin_files=d.mmap_bin_files,
    )
    if d.mock_data:
        return build_mock_gpt_datasets(list(num_samples), config, tokenizer.vocab_size - 1)
    blend = read_blend_file(d.data_args_path) if d.data_args_path else d.data_path
    return build_gpt_datasets(blend, list(num_samples), config)


def gpt_loss_terms(model: nn.Module, batch: dict[str, torch.Tensor]):
    """Masked sum of the per-token loss and the number of tokens it covers (and, with
    multi-token prediction, each depth's loss: `gpt_output_loss_terms`)."""
    output = model(
        batch["tokens"],
        position_ids=batch["position_ids"],
        attention_mask=batch.get("attention_mask"),
        labels=batch["labels"],
        return_mtp=True,
    )
    return gpt_output_loss_terms(output, batch)


def gpt_output_loss_terms(output: Tensor | tuple[Tensor, MTPLosses], batch: dict[str, Tensor]):
    """(sum of the per-token loss × loss mask, tokens) of the model's (or last stage's)
    output; with multi-token prediction also {"mtp_k loss": depth k's masked mean}, logged
    as Megatron logs them.

    Megatron adds factor/D × Σ_k (depth k's mean) to each micro-batch's loss; here that
    term rides on the loss sum with value 0 and gradient factor/D × tokens × Σ_k ∇mean_k,
    which the trainer's normalisation turns into Megatron's gradient both ways: / tokens
    / micro-batches by default, and × (tokens / global tokens) with
    --calculate-per-token-loss (core_v0.19.0's `process_mtp_loss`). The logged values are
    detached: adding them changes no gradient."""
    losses, mtp = output if isinstance(output, tuple) else (output, None)
    mask = batch["loss_mask"].float()
    loss_sum, tokens = (losses.float() * mask).sum(), mask.sum()
    if mtp is None:
        return loss_sum, tokens
    means = mtp.depth_means(mask)
    weight = mtp.scaling_factor / len(means)
    for mean in means:
        loss_sum = loss_sum + weight * tokens * (mean - mean.detach())
    return loss_sum, tokens, {f"mtp_{k + 1} loss": m.detach() for k, m in enumerate(means)}


def gpt_stage_forward(chunk: nn.Module, received: Tensor | None, batch: dict[str, Tensor]):
    """A GPT chunk's forward: token ids on the first stage, labels on the last, and there
    the token ids again for a multi-token prediction block to embed them rolled."""
    inputs = received if received is not None else batch["tokens"]
    position_ids, attention_mask = batch["position_ids"], batch.get("attention_mask")
    if not chunk.is_last:
        return chunk(inputs, position_ids, attention_mask)
    return chunk(inputs, position_ids, attention_mask, batch["labels"], input_ids=batch["tokens"])


def gpt_extra_losses(args: Args) -> tuple[str, ...]:
    return mtp_loss_names(args.mtp)


GPT_PIPELINE_STEPS = PipelineSteps(
    "tokens", gpt_stage_forward, gpt_output_loss_terms, gpt_extra_losses
)
