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

Each family's functions live in its own module (`family_gpt.py`, `family_bert.py`,
`family_t5.py`, `family_mamba.py`); this one is their registry.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from mg.trainer.arguments import Args, ArgumentError
from mg.trainer.family_bert import (
    BERT_PIPELINE_STEPS,
    bert_config,
    bert_datasets,
    bert_loss_terms,
    bert_model,
)
from mg.trainer.family_gpt import (
    GPT_PIPELINE_STEPS,
    gpt_config,
    gpt_datasets,
    gpt_loss_terms,
    gpt_model,
)
from mg.trainer.family_ict import ict_config, ict_datasets, ict_loss_terms, ict_model
from mg.trainer.family_mamba import mamba_config, mamba_model
from mg.trainer.family_retro import retro_config, retro_datasets, retro_loss_terms, retro_model
from mg.trainer.family_t5 import t5_config, t5_datasets, t5_loss_terms, t5_model
from mg.trainer.family_vlm import (
    VLM_PIPELINE_STEPS,
    vlm_config,
    vlm_datasets,
    vlm_loss_terms,
    vlm_model,
)


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


FAMILIES: dict[str, ModelFamily] = {
    "gpt": ModelFamily(
        "gpt",
        gpt_config,
        gpt_model,
        gpt_datasets,
        gpt_loss_terms,
        builds_on_meta=True,
        pipeline_steps=GPT_PIPELINE_STEPS,  # the last stage's MTP block takes the tokens
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
    "retro": ModelFamily("retro", retro_config, retro_model, retro_datasets, retro_loss_terms),
    "mamba": ModelFamily(
        "mamba", mamba_config, mamba_model, gpt_datasets, gpt_loss_terms, builds_on_meta=True
    ),
    "vlm": ModelFamily(
        "vlm",
        vlm_config,
        vlm_model,
        vlm_datasets,
        vlm_loss_terms,
        pipeline_steps=VLM_PIPELINE_STEPS,  # the towers on the first stage
    ),
    "ict": ModelFamily("ict", ict_config, ict_model, ict_datasets, ict_loss_terms),
}


def get_family(name: str) -> ModelFamily:
    if name not in FAMILIES:
        raise ArgumentError(f"unknown model family {name!r}; expected one of {sorted(FAMILIES)}")
    return FAMILIES[name]


def collate(samples: list[dict[str, np.ndarray]], device: torch.device) -> dict[str, torch.Tensor]:
    """Stack a micro-batch of dataset items into tensors on `device`."""
    keys = samples[0].keys()
    return {k: torch.from_numpy(np.stack([s[k] for s in samples])).to(device) for k in keys}
