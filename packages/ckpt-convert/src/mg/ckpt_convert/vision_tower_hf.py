"""`mg-convert import-hf` of a vision tower alone: transformers' `CLIPVisionModel` or
`SiglipVisionModel` → a `CLIPViTModel` checkpoint (Megatron-Core's `vision_model.*`
names without the prefix), what Megatron's `clip_converter.py` / `siglip_converter.py`
write for `combine-vlm` to join with a converted language model.

The tower keeps all its layers; its output is the model's `last_hidden_state` (CLIP:
the last layer's, SigLIP: after `post_layernorm`). The tensors it does not use (CLIP's
`post_layernorm` on the pooled token, SigLIP's attention-pooling `head`) are kept beside
the model (`hf_unused_tensors`), as the LLaVA import keeps its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import Tensor

from mg.ckpt_convert.errors import ConvertError
from mg.core.checkpoint import CHECKPOINT_VERSION, RELEASE, checkpoint_file, mg_metadata
from mg.core.checkpoint.layout import tracker_file
from mg.core.models.config import ConfigError
from mg.core.models.vision import CLIPViTModel, VisionConfig
from mg.core.models.vision.hf_weights import vision_config_from_hf, vision_from_hf, vision_to_hf

VISION_TOWER_MODEL_TYPES = {
    "clip_vision_model": "CLIPVisionModel",
    "siglip_vision_model": "SiglipVisionModel",
}
# transformers 4 saves the tower under `vision_model.`; transformers 5 without a prefix
_PREFIX = "vision_model."


def read_tower_weights(source: Path) -> dict[str, Tensor]:
    files = sorted(source.glob("*.safetensors"))
    if not files:
        raise ConvertError(f"{source}: no *.safetensors files (a vision tower folder has them)")
    state: dict[str, Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    return {k.removeprefix(_PREFIX): v for k, v in state.items()}


def convert_vision_tower(
    source: Path, hf_config: dict[str, Any], dtype: torch.dtype | None
) -> tuple[VisionConfig, dict[str, Tensor], dict[str, Tensor]]:
    """The folder's tower as `CLIPViTModel`'s state dict, checked against its config, and
    the source tensors it does not use."""
    try:
        config = vision_config_from_hf(hf_config)
    except (ConfigError, KeyError) as exc:
        raise ConvertError(f"{source / 'config.json'}: {exc}") from None
    hf_state = read_tower_weights(source)
    try:
        state = vision_from_hf(hf_state, config)
    except KeyError as exc:
        raise ConvertError(f"{source}: tensor {exc} is missing") from None
    used = set(vision_to_hf(state, config))
    unused = {k: v for k, v in hf_state.items() if k not in used}
    if config.vision_model_type == "clip":  # vision_to_hf writes an identity one
        unused.update((k, hf_state[k]) for k in used if k.startswith("post_layernorm."))
    with torch.device("meta"):
        expected = CLIPViTModel(config).state_dict()
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise ConvertError(
                f"{source}: shape mismatch for {name}: the weights give {tuple(tensor.shape)}, "
                f"config.json implies {tuple(expected[name].shape)}"
            )
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    return config, state, unused


def write_vision_release(
    staging: Path,
    state: dict[str, Tensor],
    config: VisionConfig,
    source: str,
    unused: dict[str, Tensor],
) -> None:
    """The tower as a `release` checkpoint in `staging`, its `mg` record holding the
    `VisionConfig`."""
    path = checkpoint_file(staging, RELEASE)
    path.parent.mkdir(parents=True)
    torch.save(
        {
            "model": state,
            "args": {"source": source, "converted_by": "mg-convert import-hf"},
            "iteration": 0,
            "mg": mg_metadata(config.to_dict()),
            "checkpoint_version": CHECKPOINT_VERSION,
            "hf_unused_tensors": unused,
        },
        path,
    )
    tracker_file(staging).write_text(RELEASE)
