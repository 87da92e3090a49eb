"""Pillow preprocessing against transformers' CLIP and SigLIP image processors on real
photographs (scikit-image's package data), and bad images refused by name."""

from __future__ import annotations

import io
import warnings

import numpy as np
import pytest
import torch

from mg.core.fixtures import fixture_path
from mg.core.models.vision.image_processing import (
    CLIP_STD,
    SIGLIP_STD,
    BadImageError,
    ImageTransform,
    load_image,
    open_rgb,
)

PHOTOS = [
    "astronaut.png",  # 512 × 512
    "chelsea.png",  # 451 × 300, landscape
    "coffee.png",
    "rocket.jpg",  # 427 × 640... as JPEG
    "motorcycle_left.png",
    "hubble_deep_field.jpg",
    "camera.png",  # greyscale
]


def _grey_levels(got: torch.Tensor, expected: np.ndarray, std) -> float:
    """Largest difference in 0..255 grey levels (undoing the per-channel std)."""
    scale = torch.tensor(std).view(3, 1, 1) * 255
    return ((got - torch.from_numpy(expected)) * scale).abs().max().item()


def _processor(kind: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from transformers import CLIPImageProcessor, SiglipImageProcessor

        if kind == "clip":
            return CLIPImageProcessor(size={"shortest_edge": 224}, crop_size=224)
        return SiglipImageProcessor(size={"height": 224, "width": 224})


@pytest.mark.parametrize("name", PHOTOS)
def test_clip_preprocessing_equals_clip_image_processor(name: str) -> None:
    from PIL import Image

    path = fixture_path("skimage-images", name)
    got = load_image(path, ImageTransform.clip(224))
    expected = _processor("clip")(Image.open(path), return_tensors="np")["pixel_values"][0]
    assert got.shape == expected.shape == (3, 224, 224)
    assert got.dtype == torch.float32
    assert _grey_levels(got, expected, CLIP_STD) <= 1.0


@pytest.mark.parametrize("name", PHOTOS[:3])
def test_siglip_preprocessing_equals_siglip_image_processor(name: str) -> None:
    from PIL import Image

    path = fixture_path("skimage-images", name)
    got = load_image(path, ImageTransform.for_vision_model("siglip", 224, 224))
    expected = _processor("siglip")(Image.open(path), return_tensors="np")["pixel_values"][0]
    assert got.shape == expected.shape == (3, 224, 224)
    assert _grey_levels(got, expected, SIGLIP_STD) <= 1.0


def test_bad_images_are_refused_by_name(tmp_path) -> None:
    from PIL import Image

    cases = {}
    cases["missing.png"] = None
    (tmp_path / "empty.png").write_bytes(b"")
    cases["empty.png"] = "not an image"
    (tmp_path / "text.jpg").write_text("hello, not a JPEG\n")
    cases["text.jpg"] = "not an image"
    whole = fixture_path("skimage-images", "chelsea.png").read_bytes()
    (tmp_path / "truncated.png").write_bytes(whole[: len(whole) // 2])
    cases["truncated.png"] = "cannot be decoded"
    Image.new("CMYK", (8, 8)).save(tmp_path / "cmyk.jpg")
    cases["cmyk.jpg"] = "CMYK"
    cases["logo.png"] = "alpha channel"
    Image.new("I;16", (8, 8)).save(tmp_path / "deep.png")
    cases["deep.png"] = "16/32-bit"
    for name, why in cases.items():
        path = fixture_path("skimage-images", name) if name == "logo.png" else tmp_path / name
        with pytest.raises(BadImageError, match=why or "no such file") as err:
            open_rgb(path)
        assert str(err.value).startswith(str(path))


def test_greyscale_becomes_rgb_and_zero_size_is_refused(monkeypatch) -> None:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("L", (4, 3), 200).save(buffer, format="PNG")
    buffer.seek(0)
    image = open_rgb(buffer, name="grey.png")
    assert image.mode == "RGB" and image.getpixel((0, 0)) == (200, 200, 200)
    # Pillow writes no 0 × 0 file; a decoder that yields one is stood in for
    monkeypatch.setattr(Image, "open", lambda *_args, **_kw: Image.new("RGB", (0, 0)))
    with pytest.raises(BadImageError, match="zero.png: the image has zero size"):
        open_rgb("zero.png")
