"""`mg-train vlm`: a LLaVA-style vision-language model (Megatron's pretrain_vlm.py).

The language model's config is the GPT family's, at `--decoder-seq-length`; the
vision tower's comes from the `--vision-model-type`, `--img-h/--img-w`,
`--patch-dim` and `--vision-*` flags (arguments/vlm.py). `--freeze-LM` and
`--freeze-ViT` turn the towers' `requires_grad` off when the model is built, so the
optimizer, its state and the gradient buffers never see them (Megatron's
`LLaVAModel.freeze`).

A sample is one image and its text: `images` [3, H, W], `tokens` [s] holding one
image token (`LLaVAConfig.image_token_index`), `labels` [s] (the next token) and
`loss_mask` [s], with s = decoder length - image tokens + 1 so that the combined
sequence is the language model's length, and `position_ids` [decoder length], that
combined sequence's positions (its length is the activations' between pipeline
stages). Loss: the language model's per-token cross entropy on text positions
(`LLaVAModel` gives image rows no loss), a mean over the loss mask, logged as `lm loss`.

Under pipeline parallelism (`VLM_PIPELINE_STEPS`) the first stage holds the vision
tower and the projector and splices the image embeddings in; every stage takes the
token ids (where the image rows are), the last one the labels and loss mask
(`mg.core.parallel.pipeline_vision`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from mg.core.models.vision import LLaVAConfig, LLaVAModel, VisionConfig
from mg.trainer.arguments import Args, ArgumentError
from mg.trainer.family_gpt import gpt_config
from mg.trainer.model_parallel import PipelineSteps
from mg.trainer.vlm_data import VLMDataError, VLMShardDataset


def vlm_config(args: Args, vocab_size: int) -> LLaVAConfig:
    """The language model (GPT flags at --decoder-seq-length), the ViT and the projector."""
    if args.checkpoint_model_config is not None:
        return LLaVAConfig.from_dict(dict(args.checkpoint_model_config))
    v, m = args.vlm, args.model
    language = dataclasses.replace(gpt_config(args, vocab_size), seq_length=m.decoder_seq_length)
    vision = VisionConfig(
        vision_model_type=v.vision_model_type,
        img_h=v.img_h,
        img_w=v.img_w,
        patch_dim=v.patch_dim,
        init_method_std=m.init_method_std,
        **v.vision_shape(),
    )
    return LLaVAConfig(
        language=language,
        vision=vision,
        projector_type=v.projector_type,
        projector_ffn_hidden_size=v.projector_ffn_hidden_size,
        drop_vision_class_token=v.disable_vision_class_token,
    )


def vlm_model(config: LLaVAConfig, args: Args | None = None) -> nn.Module:
    model = LLaVAModel(config)
    if args is not None:
        model.freeze(
            freeze_language_model=args.vlm.freeze_LM, freeze_vision_model=args.vlm.freeze_ViT
        )
    return model


class MockVLMDataset:
    """Synthetic image-text samples (`--mock-data`): sample i is drawn from a generator
    seeded by (seed, i), so every rank and every run sees the same sample i."""

    def __init__(self, size: int, config: LLaVAConfig, vocab_size: int, seed: int) -> None:
        self.size, self.config, self.vocab_size, self.seed = size, config, vocab_size, seed
        self.text_length = config.language.seq_length - config.image_tokens + 1

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, index])
        v = self.config.vision
        image = rng.standard_normal((3, v.img_h, v.img_w), dtype=np.float32)
        text = rng.integers(0, self.vocab_size, self.text_length, dtype=np.int64)
        tokens = np.concatenate([[self.config.image_token_index], text[:-1]])
        return {
            "images": image,
            "tokens": tokens,
            "labels": text,
            "loss_mask": np.ones(self.text_length, dtype=np.float32),
            "position_ids": np.arange(self.config.language.seq_length),
        }


def vlm_datasets(args: Args, tokenizer: Any, num_samples: Sequence[int]):
    """Mock image-text samples (--mock-data), or the train / val / test splits of an
    `mg-prep vlm` folder (--data-path DIR; vlm_data.py)."""
    config = vlm_config(args, tokenizer.vocab_size)
    seed = args.training.seed
    if args.data.mock_data:
        return tuple(
            MockVLMDataset(n, config, tokenizer.vocab_size, seed + split)
            for split, n in enumerate(num_samples)
        )
    folder, prompt_format = args.data.data_path[0], args.vlm.tokenizer_prompt_format
    try:
        return tuple(
            VLMShardDataset(folder, split, n, config, tokenizer, prompt_format, seed)
            for split, n in zip(("train", "val", "test"), num_samples, strict=True)
        )
    except VLMDataError as err:
        raise ArgumentError(str(err)) from None


def vlm_stage_forward(chunk: nn.Module, received: torch.Tensor | None, batch: dict):
    """A pipeline chunk's forward (`LLaVAPipelineChunk`): the first stage embeds the text
    and the images, the last one scores the text; every stage takes the token ids (where
    the image rows are)."""
    last = chunk.is_last
    return chunk(
        received,
        batch["tokens"],
        batch["images"] if chunk.is_first else None,
        batch["labels"] if last else None,
        batch["loss_mask"] if last else None,
    )


def vlm_output_loss_terms(output: tuple, batch: dict[str, torch.Tensor]):
    """(text loss summed over the combined loss mask, tokens) of the last stage's output."""
    losses, mask = output
    mask = mask.float()
    return (losses.float() * mask).sum(), mask.sum()


VLM_PIPELINE_STEPS = PipelineSteps("position_ids", vlm_stage_forward, vlm_output_loss_terms)
"""`position_ids` [b, S]: the combined sequence's length, the activations' between stages."""


def vlm_loss_terms(model: nn.Module, batch: dict[str, torch.Tensor]):
    """(text loss summed over the combined loss mask, tokens) of one micro-batch."""
    output = model(
        batch["images"], batch["tokens"], labels=batch["labels"], loss_mask=batch["loss_mask"]
    )
    return vlm_output_loss_terms(output, batch)
