"""Images in a prompt: decode, check, preprocess, embed, and where the embeddings go.

A vision-language checkpoint (`LLaVAModel`) is served as its language model
(the engine's runner) plus this module. A request's images are decoded from
base64 (Megatron's `images` field, or an OpenAI `data:` URL; a remote URL is
refused, the server has no network), checked with the same `open_rgb` as
training (not an image, truncated, alpha, CMYK, more pixels than
`--max-image-pixels`), preprocessed with the checkpoint's `ImageTransform`
(`for_vision_model`, exactly as `mg-train vlm` does) and run through the
vision tower and projector once, when the request arrives.

The prompt text carries one `<image>` tag per image. Each tag becomes
`image_tokens` rows of the prompt (placeholder id 0); `ImageRows` holds their
positions and embeddings, and the engine puts those embeddings in place of the
placeholders' token embeddings on the prefill chunks that cover them
(`rows_in`). Decoding afterwards is the language model's alone.

Rule for tags: a prompt with images and no `<image>` tag gets one `<image>\\n`
per image at its start (LLaVA's rule: the image goes before the first user
turn's text); otherwise the tags must number the images exactly.
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from mg.core.models.vision.image_processing import (
    BadImageError,
    ImageTransform,
    open_rgb,
    preprocess,
)

if TYPE_CHECKING:
    from mg.core.models.vision.llava import LLaVAModel

IMAGE_TAG = "<image>"
IMAGE_PLACEHOLDER_ID = 0
"""The id image rows carry in the engine's token list (their embeddings replace it)."""
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096


class ImageInputError(ValueError):
    """A request's image that cannot be used; the message names its field."""


def decode_base64_image(data: str, field: str, max_pixels: int | None):
    """Base64 text → an 8-bit RGB Pillow image, or ImageInputError naming `field`."""
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ImageInputError(f"{field}: not valid base64") from None
    if not raw:
        raise ImageInputError(f"{field}: the image is empty")
    try:
        return open_rgb(io.BytesIO(raw), name=field, max_pixels=max_pixels)
    except BadImageError as err:
        raise ImageInputError(str(err)) from None


def decode_image_url(url: str, field: str, max_pixels: int | None):
    """An OpenAI `image_url.url`: only `data:image/...;base64,...` (no network)."""
    if url.startswith(("http://", "https://")):
        raise ImageInputError(
            f"{field}: remote image URLs are not fetched (this server has no network); "
            "send the image inline as a data:image/png;base64,... URL"
        )
    header, comma, payload = url.partition(",")
    if not url.startswith("data:") or not comma or not header.endswith(";base64"):
        raise ImageInputError(f"{field}: must be a data:image/...;base64,... URL")
    return decode_base64_image(payload, field, max_pixels)


@dataclass
class ImageRows:
    """A prompt's image rows: their positions in the prompt and their embeddings."""

    positions: Tensor
    """[n] long, ascending."""
    embeddings: Tensor
    """[n, hidden] in the language model's dtype."""

    def shifted(self, tokens: int) -> ImageRows:
        """The same rows with `tokens` more in front of them (a BOS added to the prompt)."""
        return ImageRows(self.positions + tokens, self.embeddings)

    def rows_in(self, first: int, count: int) -> tuple[Tensor, Tensor]:
        """(offsets from `first`, embeddings) of the image rows in [first, first + count)."""
        keep = (self.positions >= first) & (self.positions < first + count)
        return self.positions[keep] - first, self.embeddings[keep]


@dataclass
class ImagePrompt:
    ids: list[int]
    """The engine's prompt: text ids, image rows as `IMAGE_PLACEHOLDER_ID`."""
    display_ids: list[int]
    """The prompt as text ids, `<image>` tokenized as text (for responses echoing it)."""
    rows: ImageRows | None


class VisionPrefill:
    """The vision side of a served LLaVA model: images → embeddings → prompt rows."""

    def __init__(self, model: LLaVAModel, max_image_pixels: int | None) -> None:
        self.model = model.eval()
        config = model.config
        vision = config.vision
        self.transform = ImageTransform.for_vision_model(
            vision.vision_model_type, vision.img_h, vision.img_w
        )
        self.image_tokens = config.image_tokens
        self.max_image_pixels = max_image_pixels

    @torch.inference_mode()
    def embed(self, images: Sequence) -> Tensor:
        """RGB images → [n · image_tokens, language hidden] (the training preprocessing)."""
        parameter = next(self.model.vision_model.parameters())
        pixels = torch.stack([preprocess(image, self.transform) for image in images])
        pixels = pixels.to(device=parameter.device, dtype=parameter.dtype)
        embeddings = self.model.image_embeddings(pixels).flatten(0, 1)
        dtype = self.model.language_model.embedding.word_embeddings.weight.dtype
        return embeddings.to(dtype)

    def prompt(
        self,
        text: str,
        images: Sequence,
        tokenize: Callable[[str], list[int]],
        field: str,
        bos: int | None = None,
    ) -> ImagePrompt:
        """Tokenize `text` around its `<image>` tags and place `images` there (see the
        module docstring for the tag rule); `field` names the prompt in errors. A BOS
        the tokenizer adds to every piece is kept on the first piece only."""
        tags = text.count(IMAGE_TAG)
        if images and tags == 0:
            text = f"{IMAGE_TAG}\n" * len(images) + text
            tags = len(images)
        if tags != len(images):
            raise ImageInputError(
                f"{field}: {tags} {IMAGE_TAG} tag(s) but {len(images)} image(s); "
                f"give one image per {IMAGE_TAG} tag"
            )
        ids: list[int] = []
        display: list[int] = []
        image_starts: list[int] = []
        for i, piece in enumerate(text.split(IMAGE_TAG)):
            if i:
                image_starts.append(len(ids))
                ids += [IMAGE_PLACEHOLDER_ID] * self.image_tokens
                display += _strip_bos(tokenize(IMAGE_TAG), bos)
            if piece:
                tokens = tokenize(piece)
                if i:
                    tokens = _strip_bos(tokens, bos)
                ids += tokens
                display += tokens
        if not images:
            return ImagePrompt(ids, display, None)
        offsets = torch.arange(self.image_tokens)
        positions = torch.cat([start + offsets for start in image_starts])
        return ImagePrompt(ids, display, ImageRows(positions, self.embed(images)))


def _strip_bos(tokens: list[int], bos: int | None) -> list[int]:
    return tokens[1:] if bos is not None and tokens and tokens[0] == bos else tokens
