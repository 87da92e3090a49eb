"""Vision-language models, LLaVA-style: a CLIP/SigLIP ViT, an MLP projector and a GPT.

from mg.core.models.vision import LLaVAConfig, LLaVAModel, VisionConfig
model = LLaVAModel(LLaVAConfig(language=gpt_config, vision=VisionConfig(...)))
logits = model(images, input_ids)  # one image token per image in input_ids
"""

from mg.core.models.vision.llava import (
    DEFAULT_IMAGE_TOKEN_INDEX,
    LLaVAConfig,
    LLaVAModel,
    combine_text_and_images,
)
from mg.core.models.vision.projector import MultimodalProjector
from mg.core.models.vision.vit import CLIPViTModel, VisionConfig, quick_gelu

__all__ = [
    "CLIPViTModel",
    "DEFAULT_IMAGE_TOKEN_INDEX",
    "LLaVAConfig",
    "LLaVAModel",
    "MultimodalProjector",
    "VisionConfig",
    "combine_text_and_images",
    "quick_gelu",
]
