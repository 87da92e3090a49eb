"""A LLaVA-style vision-language model: ViT → projector → image tokens in a GPT.

Read top to bottom (Megatron-Core's `LLaVAModel`, its names):

    images [n_img, 3, H, W] → vision_model (CLIPViTModel) → [n_img, tokens, vision hidden]
      → (--disable-vision-class-token) class token dropped
      → vision_projection (MultimodalProjector) → [n_img, tokens, language hidden]
    input_ids [b, s] with one `image_token_index` per image
      → each image token expanded in place to the image's `tokens` rows (sequence grows)
      → language_model (GPTModel) on the combined embeddings → logits or per-token loss

Images are given in reading order across the batch (row 0's images first), as
Megatron's data loader concatenates them. Labels and the loss mask come at the text
length, shifted as a GPT's (`labels[j]` is the token after `input_ids[j]`); they are
expanded with the text: image rows and the text row that predicts an image get no
loss (Megatron's `_preprocess_data`), so the loss is on text only.

The combined sequence is cut at the language model's `seq_length`, as Megatron cuts
it at `language_max_sequence_length`. Plain PyTorch: parallelism is applied from
outside to `vision_model.decoder.layers` and `language_model.decoder.layers`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from mg.core.models.config import ConfigError, TransformerConfig
from mg.core.models.gpt import GPTModel
from mg.core.models.vision.projector import PROJECTOR_TYPES, MultimodalProjector
from mg.core.models.vision.vit import CLIPViTModel, VisionConfig

DEFAULT_IMAGE_TOKEN_INDEX = -200
"""Megatron's placeholder id for `<image>` in input_ids (outside any vocabulary)."""


@dataclass
class LLaVAConfig:
    """The three towers' shapes and how they join."""

    language: TransformerConfig
    vision: VisionConfig = field(default_factory=VisionConfig)
    projector_type: str = "mlp"
    projector_ffn_hidden_size: int | None = None
    """The projector's inner width; None: the language hidden size (LLaVA-1.5's)."""
    drop_vision_class_token: bool = False
    """`--disable-vision-class-token`: the class token's feature is not given to the LM."""
    image_token_index: int = DEFAULT_IMAGE_TOKEN_INDEX

    def __post_init__(self) -> None:
        if self.projector_ffn_hidden_size is None:
            self.projector_ffn_hidden_size = self.language.hidden_size
        if self.projector_type not in PROJECTOR_TYPES:
            raise ConfigError(
                f"LLaVAConfig.projector_type: {self.projector_type!r} is not one of "
                f"{PROJECTOR_TYPES}"
            )
        if self.drop_vision_class_token and not self.vision.add_class_token:
            raise ConfigError(
                "LLaVAConfig.drop_vision_class_token: a SigLIP tower has no class token to drop"
            )

    def __getattr__(self, name: str) -> Any:
        """Fields this config lacks are the language model's (`vocab_size`,
        `num_moe_experts`, ...): the training loop, its logging and the checkpoint
        tools read a model config, and for those the VLM is its language model."""
        if name.startswith("__") or name == "language":
            raise AttributeError(name)
        return getattr(self.language, name)

    @property
    def image_tokens(self) -> int:
        """Rows one image takes in the language model's sequence."""
        drop = self.vision.class_token_len if self.drop_vision_class_token else 0
        return self.vision.seq_length - drop

    def to_dict(self) -> dict[str, Any]:
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values["language"] = self.language.to_dict()
        values["vision"] = self.vision.to_dict()
        return values

    def keys(self) -> list[str]:
        """With `__getitem__`, `dict(config)` is `to_dict()`: checkpoints record a model
        config that is not a `TransformerConfig` as such a mapping."""
        return list(self.to_dict())

    def __getitem__(self, key: str) -> Any:
        return self.to_dict()[key]

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> LLaVAConfig:
        values = dict(values)
        values["language"] = TransformerConfig.from_dict(values["language"])
        values["vision"] = VisionConfig.from_dict(values["vision"])
        return cls(**values)


@dataclass
class CombinedSequence:
    """Where the text tokens and the image rows go in the combined sequence."""

    input_ids: Tensor
    """[b, S]: the text's ids at their new places, 0 on image rows and padding."""
    image_rows: Tensor
    """[b, S] bool: the rows the image embeddings fill, in reading order."""
    labels: Tensor | None
    loss_mask: Tensor | None


def check_one_image_per_tag(input_ids: Tensor, images: Tensor | None, image_token: int) -> int:
    """The number of images, after checking it equals the `<image>` tokens in `input_ids`."""
    n_tags = int((input_ids == image_token).sum())
    n_images = 0 if images is None else images.shape[0]
    if n_tags != n_images:
        raise ValueError(
            f"input_ids hold {n_tags} image tokens ({image_token}) but {n_images} images were given"
        )
    return n_images


def combine_text_and_images(
    input_ids: Tensor,
    image_token_index: int,
    image_tokens: int,
    max_length: int,
    labels: Tensor | None = None,
    loss_mask: Tensor | None = None,
) -> CombinedSequence:
    """Expand each `image_token_index` in input_ids [b, s] to `image_tokens` rows; rows
    shorter than the longest are padded (id 0, no loss) at the end; all are cut at
    `max_length`."""
    b, s = input_ids.shape
    is_image = input_ids == image_token_index
    widths = torch.where(is_image, image_tokens, 1)
    ends = widths.cumsum(dim=1)
    starts = ends - widths  # [b, s]: where each input position lands
    length = int(ends[:, -1].max()) if s else 0
    rows = torch.arange(b, device=input_ids.device).unsqueeze(1).expand(b, s)
    text = ~is_image

    ids = torch.zeros(b, length, dtype=input_ids.dtype, device=input_ids.device)
    ids[rows[text], starts[text]] = input_ids[text]
    # image rows: for image j, starts[j] + 0..image_tokens-1
    offsets = torch.arange(image_tokens, device=input_ids.device)
    image_rows = torch.zeros(b, length, dtype=torch.bool, device=input_ids.device)
    image_cols = (starts[is_image].unsqueeze(1) + offsets).flatten()
    image_batch = rows[is_image].unsqueeze(1).expand(-1, image_tokens).flatten()
    image_rows[image_batch, image_cols] = True

    new_labels = new_mask = None
    if labels is not None:
        if loss_mask is None:
            loss_mask = torch.ones_like(labels, dtype=torch.float)
        # the text row that predicts an image (label = the image token) gets no loss
        keep = text & (labels != image_token_index)
        new_labels = torch.zeros(b, length, dtype=labels.dtype, device=labels.device)
        new_mask = torch.zeros(b, length, dtype=loss_mask.dtype, device=loss_mask.device)
        new_labels[rows[keep], starts[keep]] = labels[keep]
        new_mask[rows[keep], starts[keep]] = loss_mask[keep]
        new_labels, new_mask = new_labels[:, :max_length], new_mask[:, :max_length]
    return CombinedSequence(ids[:, :max_length], image_rows[:, :max_length], new_labels, new_mask)


def image_features(
    config: LLaVAConfig, vision_model: nn.Module, vision_projection: nn.Module, images: Tensor
) -> Tensor:
    """images [n, 3, H, W] → [n, image_tokens, language hidden]: the tower's features (its
    class token dropped where the config says) through the projector."""
    features = vision_model(images)
    if config.drop_vision_class_token:
        features = features[:, config.vision.class_token_len :]
    return vision_projection(features)


def splice_images(hidden: Tensor, combined: CombinedSequence, image_rows: Tensor | None) -> Tensor:
    """The combined sequence's token embeddings [b, S, h] with its image rows replaced by
    `image_rows` [n, image_tokens, h] (fewer kept when the cut falls inside an image)."""
    if image_rows is None:
        return hidden
    rows = image_rows.flatten(0, 1).to(hidden.dtype)
    kept = int(combined.image_rows.sum())
    return hidden.masked_scatter(combined.image_rows.unsqueeze(-1), rows[:kept])


class LLaVAModel(nn.Module):
    """`vision_model` + `vision_projection` + `language_model`, Megatron's names."""

    def __init__(self, config: LLaVAConfig) -> None:
        super().__init__()
        self.config = config
        self.vision_model = CLIPViTModel(config.vision)
        self.vision_projection = MultimodalProjector(
            config.vision.hidden_size,
            config.projector_ffn_hidden_size,
            config.language.hidden_size,
            std=config.vision.init_method_std,
        )
        self.language_model = GPTModel(config.language)
        # the combined text and image embeddings on their way into the decoder: an
        # identity, where sequence parallelism (tensor_parallel_vision) keeps this rank's
        # slice of the sequence, as Megatron scatters them after the splice
        self.decoder_input = nn.Identity()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Each tower's own init, vision first (Megatron builds the LM first; no
        checkpoint depends on the order of the random draws)."""
        self.vision_model.init_weights()
        self.vision_projection.init_weights()
        self.language_model.init_weights()

    def freeze(
        self,
        freeze_language_model: bool = False,
        freeze_vision_model: bool = False,
        freeze_vision_projection: bool = False,
    ) -> None:
        """`--freeze-LM`, `--freeze-ViT`: the tower's parameters take no gradient (and
        so get no gradient buffer and no optimizer state)."""
        for frozen, tower in (
            (freeze_language_model, self.language_model),
            (freeze_vision_model, self.vision_model),
            (freeze_vision_projection, self.vision_projection),
        ):
            if frozen:
                tower.requires_grad_(False)

    def image_embeddings(self, images: Tensor) -> Tensor:
        """images [n, 3, H, W] → [n, image_tokens, language hidden]."""
        return image_features(self.config, self.vision_model, self.vision_projection, images)

    def forward(
        self,
        images: Tensor | None,
        input_ids: Tensor,
        labels: Tensor | None = None,
        loss_mask: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """input_ids [b, s] with one `image_token_index` per image, images [n, 3, H, W]
        (None or n = 0 for text only) → logits [b, S, vocab] over the combined
        sequence; with labels [b, s] (and loss_mask), (per-token fp32 loss [b, S],
        loss mask [b, S]) with no loss on image rows."""
        config = self.config
        n_images = check_one_image_per_tag(input_ids, images, config.image_token_index)
        combined = combine_text_and_images(
            input_ids,
            config.image_token_index,
            config.image_tokens,
            config.language.seq_length,
            labels,
            loss_mask,
        )
        b, length = combined.input_ids.shape
        position_ids = torch.arange(length, device=input_ids.device).expand(b, length)
        lm = self.language_model
        hidden = lm.embedding(combined.input_ids, position_ids)
        image_rows = self.image_embeddings(images) if n_images else None
        hidden = splice_images(hidden, combined, image_rows)
        hidden = lm.run_decoder(self.decoder_input(hidden), position_ids, None)
        if labels is None:
            return lm.output_and_loss(hidden, None)
        return lm.output_and_loss(hidden, combined.labels), combined.loss_mask
