"""Images → the ViT's input: decode, RGB, resize, crop, normalise, with Pillow only.

CLIP's recipe (transformers' `CLIPImageProcessor`, the one LLaVA-1.5 uses):

    RGB → resize so the shorter edge is `size` (bicubic; the longer edge
    int(size · long / short)) → centre crop crop_h × crop_w (top = (h - crop_h) // 2)
    → / 255 → (x - mean) / std per channel → [3, crop_h, crop_w] float32

SigLIP's processor resizes straight to crop_h × crop_w (no crop) with mean = std =
0.5: `ImageTransform.siglip(size)`.

Pillow is imported where an image is opened, so importing this module costs nothing
(command-line `--help` stays instant).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

if TYPE_CHECKING:
    from PIL.Image import Image

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
SIGLIP_MEAN = (0.5, 0.5, 0.5)
SIGLIP_STD = (0.5, 0.5, 0.5)


class BadImageError(ValueError):
    """An image file that cannot be used; the message names the file and why."""


@dataclass(frozen=True)
class ImageTransform:
    """How an image becomes the ViT's input; `shortest_edge` None resizes straight to
    crop_h × crop_w (SigLIP), else shorter edge → shortest_edge, then a centre crop."""

    crop_h: int
    crop_w: int
    shortest_edge: int | None
    mean: tuple[float, float, float] = CLIP_MEAN
    std: tuple[float, float, float] = CLIP_STD

    @classmethod
    def clip(cls, size: int) -> ImageTransform:
        return cls(size, size, size, CLIP_MEAN, CLIP_STD)

    @classmethod
    def siglip(cls, size: int) -> ImageTransform:
        return cls(size, size, None, SIGLIP_MEAN, SIGLIP_STD)

    @classmethod
    def for_vision_model(cls, vision_model_type: str, img_h: int, img_w: int) -> ImageTransform:
        """The preprocessing each tower was trained with, at --img-h × --img-w."""
        if vision_model_type == "siglip":
            return cls(img_h, img_w, None, SIGLIP_MEAN, SIGLIP_STD)
        return cls(img_h, img_w, min(img_h, img_w), CLIP_MEAN, CLIP_STD)


def open_rgb(
    source: str | Path | Any, name: str | None = None, max_pixels: int | None = None
) -> Image:
    """Open an image (path or binary file object) as 8-bit RGB, decoded in full.

    Refused by name, as `BadImageError`: a missing, empty, truncated or undecodable
    file, a zero-size image, and modes that an RGB conversion would silently change
    (CMYK colours, an alpha channel, 16/32-bit or float samples), and, with
    `max_pixels`, an image of more pixels (checked before decoding). Greyscale (L) and
    palette images without transparency are converted to RGB, as CLIP's processor does.
    """
    from PIL import Image, UnidentifiedImageError  # lazy: Pillow only where images are read

    label = name or str(source)
    try:
        with Image.open(source) as image:
            pixels = image.width * image.height
            if max_pixels is not None and pixels > max_pixels:
                raise BadImageError(
                    f"{label}: {image.width} × {image.height} = {pixels} pixels is more "
                    f"than the limit of {max_pixels}"
                )
            image.load()  # decode now: a truncated file fails here, not mid-training
            mode = image.mode
            if image.width == 0 or image.height == 0:
                raise BadImageError(f"{label}: the image has zero size")
            if mode == "CMYK":
                raise BadImageError(f"{label}: CMYK image; convert it to RGB first")
            if mode in ("RGBA", "LA", "La", "RGBa", "PA") or "transparency" in image.info:
                raise BadImageError(f"{label}: the image has an alpha channel ({mode})")
            if mode not in ("RGB", "L", "P", "1"):
                raise BadImageError(
                    f"{label}: {mode} samples (16/32-bit or float) are not 8-bit RGB"
                )
            return image.convert("RGB")
    except FileNotFoundError:
        raise BadImageError(f"{label}: no such file") from None
    except UnidentifiedImageError:
        raise BadImageError(f"{label}: not an image Pillow can read") from None
    except Image.DecompressionBombError as err:
        raise BadImageError(f"{label}: {err}") from None
    except (OSError, SyntaxError, ValueError) as err:
        if isinstance(err, BadImageError):
            raise
        raise BadImageError(f"{label}: cannot be decoded ({err})") from None


def resize_and_crop(image: Image, transform: ImageTransform) -> Image:
    """The resize (bicubic) and centre crop of `transform`, on the 8-bit image."""
    from PIL import Image as PILImage  # lazy: Pillow only where images are read

    bicubic = PILImage.Resampling.BICUBIC
    if transform.shortest_edge is None:
        return image.resize((transform.crop_w, transform.crop_h), bicubic)
    w, h = image.size
    short, long = (w, h) if w <= h else (h, w)
    new_long = int(transform.shortest_edge * long / short)
    size = (transform.shortest_edge, new_long) if w <= h else (new_long, transform.shortest_edge)
    image = image.resize(size, bicubic)
    w, h = image.size
    top, left = (h - transform.crop_h) // 2, (w - transform.crop_w) // 2
    return image.crop((left, top, left + transform.crop_w, top + transform.crop_h))


def normalize(image: Image, transform: ImageTransform) -> Tensor:
    """8-bit RGB → [3, H, W] float32: / 255, then (x - mean) / std per channel."""
    pixels = np.asarray(image, dtype=np.float32) * np.float32(1 / 255)
    mean = np.asarray(transform.mean, dtype=np.float32)
    std = np.asarray(transform.std, dtype=np.float32)
    return torch.from_numpy(((pixels - mean) / std).transpose(2, 0, 1).copy())


def preprocess(image: Image, transform: ImageTransform) -> Tensor:
    """An RGB image → the ViT's input [3, crop_h, crop_w] float32."""
    return normalize(resize_and_crop(image, transform), transform)


def load_image(path: str | Path, transform: ImageTransform) -> Tensor:
    """`open_rgb` then `preprocess`: a file → [3, crop_h, crop_w] float32."""
    return preprocess(open_rgb(path), transform)
