"""Pipeline parallelism for a LLaVAModel: the towers on the first stage, the LM's layers split.

As Megatron-Core's `LLaVAModel` with `pre_process` (its first stage builds the vision
model and the projector, every stage its part of the language model):

    first stage   vision_model, vision_projection, language_model (embedding + its layers)
                  images → image embeddings, spliced into the text's embeddings at the
                  image tokens, then this stage's layers
    later stages  language_model (its layers; the last one the final norm and the output)

The language model's layers are assigned as a GPT's (`pipeline.layer_ranges`), and its
part on each stage is a GPT `PipelineChunk` held as `language_model`, so a chunk's
names are Megatron's LLaVA names with the layers numbered locally
(`language_model.decoder.layers.0`), and `pipeline.global_parameter_name` maps them
back to the whole model's. The combined sequence is the language model's
`seq_length` on every stage (one image per sample fills it, as the data gives it): the
activations crossing stages are [b, seq_length, h]. The last stage rebuilds the
combined labels and loss mask from the token ids (where the images went needs no
image), so it returns what the whole model returns: (per-token loss, loss mask).

Frozen towers stay frozen on every stage: a tied output layer's copy on the last stage
takes the embedding's `requires_grad`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mg.core.models.vision import LLaVAModel
from mg.core.models.vision.llava import (
    check_one_image_per_tag,
    combine_text_and_images,
    image_features,
    splice_images,
)
from mg.core.parallel.pipeline import PipelineChunk, layer_ranges


class LLaVAPipelineChunk(nn.Module):
    """The language model's layers [start, end) as a GPT `PipelineChunk`, with the vision
    tower and the projector on the first stage.

    forward(input, input_ids, images, labels, loss_mask): `input` is None on the first
    stage (it embeds `input_ids` [b, s] and `images`), the previous stage's hidden states
    [b, S, h] elsewhere; the last stage returns (per-token loss [b, S], loss mask [b, S])
    with labels, logits without; the others the hidden states."""

    def __init__(self, model: LLaVAModel, start: int, end: int, first: bool, last: bool) -> None:
        super().__init__()
        self.config = model.config
        self.vision_model = model.vision_model if first else None
        self.vision_projection = model.vision_projection if first else None
        self.decoder_input = model.decoder_input if first else None
        self.language_model = PipelineChunk(model.language_model, start, end, first, last)
        if last and not first and model.language_model.output_layer is None:  # tied: a copy
            words = model.language_model.embedding.word_embeddings.weight
            self.language_model.output_layer.weight.requires_grad_(words.requires_grad)
        self.is_first, self.is_last = first, last
        self.layer_offset = start

    # what the pipeline helpers read off a GPT chunk (the tied embedding and its copy)
    @property
    def embedding(self) -> nn.Module | None:
        return self.language_model.embedding

    @property
    def output_layer(self) -> nn.Module | None:
        return self.language_model.output_layer

    def _embed(self, input_ids: Tensor, images: Tensor | None) -> Tensor:
        """The first stage's input to its layers: text and image embeddings combined."""
        config = self.config
        combined = combine_text_and_images(
            input_ids, config.image_token_index, config.image_tokens, config.language.seq_length
        )
        hidden = self.language_model.embedding(combined.input_ids, self._positions(input_ids))
        if images is None or images.shape[0] == 0:
            return hidden
        rows = image_features(config, self.vision_model, self.vision_projection, images)
        return splice_images(hidden, combined, rows)

    def _positions(self, input_ids: Tensor) -> Tensor:
        """[b, S]: the combined sequence's positions (every stage's rotary embedding)."""
        length = self.config.language.seq_length
        return torch.arange(length, device=input_ids.device).expand(input_ids.shape[0], length)

    def forward(
        self,
        input: Tensor | None,
        input_ids: Tensor,
        images: Tensor | None = None,
        labels: Tensor | None = None,
        loss_mask: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        config = self.config
        if self.is_first:
            check_one_image_per_tag(input_ids, images, config.image_token_index)
        hidden = self.decoder_input(self._embed(input_ids, images)) if self.is_first else input
        lm = self.language_model
        hidden = lm.run_decoder(hidden, self._positions(input_ids), None)
        if not self.is_last:
            return hidden
        if labels is None:
            return lm.output_and_loss(hidden, None)
        combined = combine_text_and_images(
            input_ids,
            config.image_token_index,
            config.image_tokens,
            config.language.seq_length,
            labels,
            loss_mask,
        )
        return lm.output_and_loss(hidden, combined.labels), combined.loss_mask


def split_llava_model(
    model: LLaVAModel, pipeline_rank: int, pipeline_size: int, virtual_size: int = 1
) -> list[LLaVAPipelineChunk]:
    """This pipeline rank's chunks of a LLaVAModel (the language model's layers assigned as
    a GPT's; the towers on the first virtual stage)."""
    ranges = layer_ranges(model.config.language.num_layers, pipeline_size, virtual_size)
    last_chunk = virtual_size - 1
    return [
        LLaVAPipelineChunk(
            model,
            start,
            end,
            first=pipeline_rank == 0 and c == 0,
            last=pipeline_rank == pipeline_size - 1 and c == last_chunk,
        )
        for c, (start, end) in enumerate(ranges[pipeline_rank])
    ]
