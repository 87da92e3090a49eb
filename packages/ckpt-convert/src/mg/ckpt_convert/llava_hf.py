"""`mg-convert import-hf` of transformers' `LlavaForConditionalGeneration` (CLIP or
SigLIP tower).

    model.vision_tower.*          → vision_model.*       (mg.core.models.vision.hf_weights)
    model.multi_modal_projector.* → vision_projection.*
    model.language_model.*, lm_head.weight → language_model.* (the text model's own table)

LLaVA feeds the projector from `vision_feature_layer` (-2: the penultimate layer's
output); the tower is imported with the layers up to it only, as Megatron's
converters do, so `vision_model` ends where LLaVA reads. `vision_feature_select_strategy`
"default" drops the class token (`--disable-vision-class-token`), "full" keeps it.
The image token id becomes `image_token_index`: one such token in `input_ids` stands
for the whole image (Megatron's convention), where transformers' processor writes it
once per image row.

A SigLIP tower (`vision_config.model_type` siglip_vision_model, strategy "full": it
has no class token) ends in `ln_post` in Megatron's ViT, where LLaVA reads
`hidden_states[layer]`, before SigLIP's `post_layernorm`: `ln_post` is left out
(`VisionConfig.siglip_ln_post` false) and SigLIP's own norm kept aside with its
attention-pooling `head`.

The tensors LLaVA never reads (the vision layers after the feature layer, CLIP's
`post_layernorm`, SigLIP's `post_layernorm` and `head`) are kept in the checkpoint
beside the model (`hf_unused_tensors`),
so `export-hf` gives the source folder's tensors back bit for bit.

The weights are read whole (a LLaVA-7B's 14 GB in bf16 fit where one converts it);
the checkpoint is a `release` one like import-hf's, its `mg` record holding the
`LLaVAConfig`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from mg.ckpt_convert.errors import ConvertError
from mg.core.checkpoint import CHECKPOINT_VERSION, RELEASE, checkpoint_file, mg_metadata
from mg.core.checkpoint.layout import read_latest_iteration, tracker_file
from mg.core.models import pad_vocab_size
from mg.core.models.hf_mapping import (
    config_from_hf,
    get_architecture,
    hf_to_megatron,
    megatron_to_hf,
)
from mg.core.models.vision import LLaVAConfig, LLaVAModel
from mg.core.models.vision.hf_weights import (
    projector_from_hf,
    projector_to_hf,
    vision_config_from_hf,
    vision_from_hf,
    vision_to_hf,
)

LLAVA_MODEL_TYPE = "llava"
VISION_PREFIX = "vision_tower."
PROJECTOR_PREFIX = "multi_modal_projector."
# the text model's keys as its own *ForCausalLM names them, from either file layout
_TEXT_KEYS = (
    ("language_model.model.", "model."),  # llava-hf's files (and save_pretrained's)
    ("model.language_model.", "model."),  # transformers 5's modules
    ("language_model.lm_head.", "lm_head."),
    ("lm_head.", "lm_head."),
)


def canonical_keys(hf_state: dict[str, Tensor]) -> dict[str, Tensor]:
    """LLaVA's tensors under one naming: `vision_tower.*` (CLIPVisionTransformer's names),
    `multi_modal_projector.*` and the text model's `model.*` / `lm_head.*`. Files from
    llava-hf write `vision_tower.vision_model.*` and `language_model.model.*`; a
    transformers 5 state dict `model.vision_tower.*` and `model.language_model.*`."""
    out: dict[str, Tensor] = {}
    for key, tensor in hf_state.items():
        name = key
        if name.startswith(("model.vision_tower.", "model.multi_modal_projector.")):
            name = name.removeprefix("model.")
        if name.startswith("vision_tower.vision_model."):
            name = "vision_tower." + name.removeprefix("vision_tower.vision_model.")
        for old, new in _TEXT_KEYS:
            if name.startswith(old):
                name = new + name.removeprefix(old)
                break
        out[name] = tensor
    return out


def llava_config_from_hf(hf_config: dict[str, Any], make_vocab_size_divisible_by: int = 128):
    """LLaVA's config.json → `LLaVAConfig` (the language vocabulary padded as Megatron's)."""
    where = "config.json"
    layer = hf_config.get("vision_feature_layer", -2)
    if not isinstance(layer, int):
        raise ConvertError(
            f"{where}: vision_feature_layer {layer!r}: features from several layers "
            "(a list) are not supported; one layer index is"
        )
    strategy = hf_config.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise ConvertError(f"{where}: vision_feature_select_strategy {strategy!r} is unknown")
    if hf_config.get("projector_hidden_act", "gelu") != "gelu":
        raise ConvertError(
            f"{where}: projector_hidden_act {hf_config['projector_hidden_act']!r}: the "
            "projector computes gelu"
        )
    if not hf_config.get("multimodal_projector_bias", True):
        raise ConvertError(f"{where}: multimodal_projector_bias false: the projector has biases")
    vision_hf = hf_config["vision_config"]
    total = vision_hf.get("num_hidden_layers", 24)
    layers = total + layer + 1 if layer < 0 else layer
    if not 0 < layers <= total:
        raise ConvertError(f"{where}: vision_feature_layer {layer} is outside the tower's layers")
    try:
        vision = vision_config_from_hf(vision_hf, num_layers=layers)
        if vision.vision_model_type == "siglip":  # LLaVA reads a layer's output, unnormed
            vision = dataclasses.replace(vision, siglip_ln_post=False)
        text = config_from_hf(hf_config["text_config"])
    except (KeyError, ValueError) as exc:
        raise ConvertError(f"{where}: {exc}") from None
    if vision.vision_model_type == "siglip" and strategy == "default":
        raise ConvertError(
            f"{where}: vision_feature_select_strategy 'default' drops the first row as a "
            "class token, and a SigLIP tower has none (its first patch would go): 'full' is "
            "supported"
        )
    hf_vocab = text.vocab_size
    language = dataclasses.replace(
        text,
        vocab_size=pad_vocab_size(hf_vocab, make_vocab_size_divisible_by),
        extra=dict(text.extra, hf_vocab_size=hf_vocab),
    )
    image_token = hf_config.get("image_token_id", hf_config.get("image_token_index"))
    if image_token is None:
        raise ConvertError(f"{where}: no image_token_id")
    return LLaVAConfig(
        language=language,
        vision=vision,
        projector_ffn_hidden_size=language.hidden_size,
        drop_vision_class_token=strategy == "default",
        image_token_index=image_token,
    )


def llava_state_from_hf(hf_state: dict[str, Tensor], config: LLaVAConfig) -> dict[str, Tensor]:
    """transformers' LLaVA state dict → `LLaVAModel`'s (vocabulary rows padded)."""
    hf_state = canonical_keys(hf_state)
    state = {
        f"vision_model.{k}": v
        for k, v in vision_from_hf(hf_state, config.vision, prefix=VISION_PREFIX).items()
    }
    state.update(
        (f"vision_projection.{k}", v)
        for k, v in projector_from_hf(hf_state, prefix=PROJECTOR_PREFIX).items()
    )
    text = {k: v for k, v in hf_state.items() if k.startswith(("model.", "lm_head."))}
    language = config.language
    arch = get_architecture(language.extra["hf_model_type"])
    for name, tensor in hf_to_megatron(text, language, arch).items():
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            padded = tensor.new_zeros((language.vocab_size, *tensor.shape[1:]))
            padded[: tensor.shape[0]] = tensor
            tensor = padded
        state[f"language_model.{name}"] = tensor
    return state


def read_llava_weights(source: Path, what: str = "a LLaVA") -> dict[str, Tensor]:
    """Every tensor of the folder's *.safetensors files (`what` names the folder's kind)."""
    files = sorted(source.glob("*.safetensors"))
    if not files:
        raise ConvertError(f"{source}: no *.safetensors files ({what} folder has them)")
    state: dict[str, Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    return state


def convert_llava(
    source: Path, hf_config: dict[str, Any], dtype: torch.dtype | None, divisible_by: int
) -> tuple[LLaVAConfig, dict[str, Tensor], dict[str, Tensor]]:
    """The folder's config and weights as ours, checked against the model they describe,
    and the source tensors the model does not use (kept for export)."""
    config = llava_config_from_hf(hf_config, divisible_by)
    config.language.extra["hf_config"] = hf_config
    hf_state = canonical_keys(read_llava_weights(source))
    state = llava_state_from_hf(hf_state, config)
    used = set(canonical_keys(llava_state_to_hf(state, config)))
    unused = {k: v for k, v in hf_state.items() if k not in used}
    with torch.device("meta"):
        expected = LLaVAModel(config).state_dict()
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ConvertError(f"{source}: {len(missing)} tensors are missing, e.g. {missing[:4]}")
    for name, tensor in state.items():
        if name not in expected:
            raise ConvertError(f"{source}: {name} is not a parameter of this model")
        if tensor.shape != expected[name].shape:
            raise ConvertError(
                f"{source}: shape mismatch for {name}: the weights give {tuple(tensor.shape)}, "
                f"config.json implies {tuple(expected[name].shape)}"
            )
        if dtype is not None:
            state[name] = tensor.to(dtype)
    return config, state, unused


def llava_state_to_hf(state: dict[str, Tensor], config: LLaVAConfig) -> dict[str, Tensor]:
    """`LLaVAModel`'s state dict → transformers' file names (llava-hf's layout, as
    `save_pretrained` writes it), the padded vocabulary rows cut off."""

    def part(prefix: str) -> dict[str, Tensor]:
        return {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}

    out = {
        VISION_PREFIX + k: v for k, v in vision_to_hf(part("vision_model."), config.vision).items()
    }
    out.update(
        (PROJECTOR_PREFIX + k, v) for k, v in projector_to_hf(part("vision_projection.")).items()
    )
    language = config.language
    hf_vocab = language.extra.get("hf_vocab_size", language.vocab_size)
    text = {
        k: v[:hf_vocab] if k in ("embedding.word_embeddings.weight", "output_layer.weight") else v
        for k, v in part("language_model.").items()
    }
    arch = get_architecture(language.extra["hf_model_type"])
    for name, tensor in megatron_to_hf(text, language, arch).items():
        out["language_model." + name] = tensor
    return out


def write_llava_release(
    staging: Path,
    state: dict[str, Tensor],
    config: LLaVAConfig,
    tokenizer_config: Any,
    source: str,
    unused: dict[str, Tensor] | None = None,
) -> None:
    """The converted model as a `release` checkpoint in `staging` (what import-hf writes)."""
    path = checkpoint_file(staging, RELEASE)
    path.parent.mkdir(parents=True)
    torch.save(
        {
            "model": state,
            "args": {"source": source, "converted_by": "mg-convert import-hf"},
            "iteration": 0,
            "mg": mg_metadata(
                config.to_dict(), tokenizer_config.to_dict() if tokenizer_config else None
            ),
            "checkpoint_version": CHECKPOINT_VERSION,
            "hf_unused_tensors": unused or {},
        },
        path,
    )
    tracker_file(staging).write_text(RELEASE)


def is_llava_checkpoint(load: str | Path) -> bool:
    """Whether `load` holds a one-file (`torch`, one rank) LLaVA checkpoint."""
    path = _checkpoint_path(load)
    if path is None:
        return False
    # mmap: only the pickled record is read, not the tensors
    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except (RuntimeError, OSError, ValueError):  # not a zip-format file: not ours to read
        return False
    config = (state.get("mg") or {}).get("model_config") or {}
    return "vision" in config and "language" in config


def _checkpoint_path(load: str | Path) -> Path | None:
    iteration = read_latest_iteration(load)
    if iteration is None:
        return None
    path = checkpoint_file(load, iteration)
    return path if path.is_file() else None


def export_llava(load: str | Path, staging: Path) -> None:
    """A LLaVA checkpoint → a transformers folder in `staging`: the tensors (with those
    import kept aside), the source's config.json, the tokenizer files."""
    path = _checkpoint_path(load)
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    config = LLaVAConfig.from_dict(checkpoint["mg"]["model_config"])
    hf_config = config.language.extra.get("hf_config")
    if hf_config is None:
        raise ConvertError(
            f"{load}: a LLaVA model trained from scratch has no transformers config to "
            "export to yet; export-hf writes models imported with import-hf"
        )
    tensors = llava_state_to_hf(checkpoint["model"], config)
    tensors.update(checkpoint.get("hf_unused_tensors") or {})
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(staging / "model.safetensors"))
    (staging / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
