"""Model families `mg-train` knows: how to build the model, its datasets and its loss.

A family is three functions, so BERT and T5 plug in beside GPT without the
training loop knowing which one runs:

- `build_config(args, vocab_size)` -> the model config (recorded in checkpoints);
- `build_model(config, args)` -> an `nn.Module` with Megatron's init;
- `build_datasets(args, tokenizer, num_samples)` -> (train, valid, test);
- `loss_terms(model, batch)` -> (sum of per-token loss * mask, number of tokens),
  which the loop turns into Megatron's averages, optionally with a third item:
  named extra losses, each already a mean over the micro-batch, added to the
  objective and logged beside `lm loss` (BERT's `sop loss`).

GPT lives here; BERT and T5 in `family_bert.py` and `family_t5.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from mg.trainer.arguments import Args, ArgumentError
from mg.trainer.arguments.moe import moe_config_fields


@dataclass(frozen=True)
class ModelFamily:
    name: str
    build_config: Callable[[Args, int], Any]
    build_model: Callable[[Any, Args], nn.Module]
    build_datasets: Callable[[Args, Any, Sequence[int]], tuple[Any, Any, Any]]
    loss_terms: Callable[[nn.Module, dict[str, torch.Tensor]], tuple]
    builds_on_meta: bool = False
    """`build_model` works on the meta device and the model has `init_units()`: each rank
    then materialises only its own shards (mg.core.parallel.materialize)."""
    pipeline_steps: Any = None
    """How a micro-batch goes through pipeline stages (`model_parallel.PipelineSteps`);
    None: GPT's."""


# --- GPT -------------------------------------------------------------------------------------


def gpt_config(args: Args, vocab_size: int):
    """Megatron's GPT flags onto `TransformerConfig`."""
    from mg.core.models import TransformerConfig
    from mg.core.models.config import RopeScaling

    if args.checkpoint_model_config is not None:
        # --use-checkpoint-args: the checkpoint's config, whole (see checkpoint_args.py),
        # but this run's attention kernel (it does not change the weights)
        recorded = dict(args.checkpoint_model_config)
        recorded["attention_backend"] = args.transformer_engine.attention_backend
        return TransformerConfig.from_dict(recorded)
    m = args.model
    activation = "swiglu" if m.swiglu else "gelu"
    return TransformerConfig(
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
    )


def gpt_model(config, args: Args | None = None) -> nn.Module:
    from mg.core.models import GPTModel

    return GPTModel(config)


def gpt_datasets(args: Args, tokenizer: Any, num_samples: Sequence[int]):
    """Megatron's GPT datasets: mock, `--data-path` words or a blend file."""
    from mg.indexed_dataset import (
        GPTDatasetConfig,
        build_gpt_datasets,
        build_mock_gpt_datasets,
        read_blend_file,
    )

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
    """Masked sum of the per-token loss and the number of tokens it covers."""
    losses = model(
        batch["tokens"],
        position_ids=batch["position_ids"],
        attention_mask=batch.get("attention_mask"),
        labels=batch["labels"],
    )
    mask = batch["loss_mask"].float()
    return (losses.float() * mask).sum(), mask.sum()


from mg.trainer.family_bert import (  # noqa: E402  (they use gpt_config from here)
    BERT_PIPELINE_STEPS,
    bert_config,
    bert_datasets,
    bert_loss_terms,
    bert_model,
)
from mg.trainer.family_mamba import mamba_config, mamba_model  # noqa: E402
from mg.trainer.family_t5 import t5_config, t5_datasets, t5_loss_terms, t5_model  # noqa: E402

FAMILIES: dict[str, ModelFamily] = {
    "gpt": ModelFamily(
        "gpt", gpt_config, gpt_model, gpt_datasets, gpt_loss_terms, builds_on_meta=True
    ),
    "bert": ModelFamily(
        "bert",
        bert_config,
        bert_model,
        bert_datasets,
        bert_loss_terms,
        pipeline_steps=BERT_PIPELINE_STEPS,
    ),
    "t5": ModelFamily("t5", t5_config, t5_model, t5_datasets, t5_loss_terms),
    "mamba": ModelFamily(
        "mamba", mamba_config, mamba_model, gpt_datasets, gpt_loss_terms, builds_on_meta=True
    ),
}


def get_family(name: str) -> ModelFamily:
    if name not in FAMILIES:
        raise ArgumentError(f"unknown model family {name!r}; expected one of {sorted(FAMILIES)}")
    return FAMILIES[name]


def collate(samples: list[dict[str, np.ndarray]], device: torch.device) -> dict[str, torch.Tensor]:
    """Stack a micro-batch of dataset items into tensors on `device`."""
    keys = samples[0].keys()
    return {k: torch.from_numpy(np.stack([s[k] for s in samples])).to(device) for k in keys}
