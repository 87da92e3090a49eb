"""`mg-convert import-hf` of a vision tower alone: transformers' `CLIPVisionModel` or
`SiglipVisionModel` → a `CLIPViTModel` checkpoint (Megatron-Core's `vision_model.*`
names without the prefix), what Megatron's `clip_converter.py` / `siglip_converter.py`
write for `combine-vlm` to join with a converted language model.

The tower keeps all its layers; its output is the model's `last_hidden_state` (CLIP:
the last layer's, SigLIP: after `post_layernorm`). The tensors it does not use (CLIP's
`post_layernorm` on the pooled token, SigLIP's attention-pooling `head`) are kept beside
the model (`hf_unused_tensors`), as the LLaVA import keeps its own, and the source's
config.json (`hf_config`): `export-hf` writes the folder back bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor

from mg.ckpt_convert.errors import ConvertError
from mg.ckpt_convert.llava_hf import read_llava_weights
from mg.core.checkpoint import CHECKPOINT_VERSION, RELEASE, checkpoint_file, mg_metadata
from mg.core.checkpoint.layout import read_latest_iteration, tracker_file
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
    state = read_llava_weights(source, "a vision tower")
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
    hf_config: dict[str, Any],
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
            "hf_config": hf_config,
        },
        path,
    )
    tracker_file(staging).write_text(RELEASE)


def _vision_checkpoint(load: str | Path) -> dict[str, Any] | None:
    """`load`'s one-file checkpoint when it holds a vision tower alone (mmap: the record
    is read, not the tensors)."""
    iteration = read_latest_iteration(load)
    if iteration is None or not checkpoint_file(load, iteration).is_file():
        return None
    try:
        state = torch.load(
            checkpoint_file(load, iteration), map_location="cpu", mmap=True, weights_only=False
        )
    except (RuntimeError, OSError, ValueError):  # not a zip-format file: not ours to read
        return None
    config = (state.get("mg") or {}).get("model_config") or {}
    return state if "vision_model_type" in config else None


def is_vision_tower_checkpoint(load: str | Path) -> bool:
    return _vision_checkpoint(load) is not None


def export_vision_tower(load: str | Path, staging: Path) -> None:
    """A tower imported by import-hf → its transformers folder (tensors, config.json)."""
    checkpoint = _vision_checkpoint(load)
    hf_config = checkpoint.get("hf_config")
    if hf_config is None:
        raise ConvertError(
            f"{load}: a vision tower without its transformers config; export-hf writes "
            "towers imported with import-hf"
        )
    config = VisionConfig.from_dict(checkpoint["mg"]["model_config"])
    tensors = vision_to_hf(checkpoint["model"], config)
    tensors.update(checkpoint.get("hf_unused_tensors") or {})
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(staging / "model.safetensors"))
    (staging / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
