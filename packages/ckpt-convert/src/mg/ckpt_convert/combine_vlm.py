"""`mg-convert combine-vlm`: Megatron's "combine checkpoints" step
(`examples/multimodal/combine_state_dicts.py`): a converted language model and a
converted vision tower, each input's weights renamed `<prefix>.<name>`, written as one
checkpoint that `mg-train vlm --pretrained-checkpoint` starts from.

As Megatron's, the projector is not in it unless an input gives one (prefix
`vision_projection`: a VLM checkpoint's `vision_projection.*`, or a projector's own
`encoder.*`); a run then adds `--allow-missing-vision-projection-checkpoint`. The
output is a `torch_dist` folder at iteration 1 (Megatron writes `iter_0000001` and the
tracker "1"), Megatron-Core's `LLaVAModel` keys: the format in which a checkpoint
without the projector loads, at any TP/PP.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mg.ckpt_convert.errors import ConvertError
from mg.core.checkpoint import CHECKPOINT_VERSION, checkpoint_file, mg_metadata
from mg.core.checkpoint.dist_format import save_dist_checkpoint
from mg.core.checkpoint.layout import read_latest_iteration
from mg.core.checkpoint.megatron_dist import megatron_model_state
from mg.core.checkpoint.megatron_sharded_keys import key_layout
from mg.core.models import TransformerConfig
from mg.core.models.vision import LLaVAConfig, VisionConfig

PREFIXES = ("language_model", "vision_model", "vision_projection")
ITERATION = 1  # Megatron's combined checkpoint: iter_0000001


def _read(folder: str) -> dict[str, Any]:
    """A one-file (`torch` format, one rank) mg checkpoint: import-hf's `release`, or a
    run's latest iteration."""
    iteration = read_latest_iteration(folder)
    if iteration is None:
        raise ConvertError(f"--input {folder}: no latest_checkpointed_iteration.txt there")
    path = checkpoint_file(folder, iteration)
    if not path.is_file():
        raise ConvertError(
            f"--input {folder}: no {path.relative_to(folder)} (a one-rank `torch` checkpoint "
            "is combined; `mg-convert reshard` or `format --to torch` makes one)"
        )
    state = torch.load(path, map_location="cpu", weights_only=False)
    if not (state.get("mg") or {}).get("model_config"):
        raise ConvertError(f"--input {folder}: no mg model config in {path.name}")
    return state


def _projector(state: dict[str, Any], folder: str) -> dict[str, Tensor]:
    model = state["model"]
    inner = {
        k.removeprefix("vision_projection."): v
        for k, v in model.items()
        if k.startswith("vision_projection.")
    }
    found = inner or {k: v for k, v in model.items() if k.startswith("encoder.linear_fc")}
    if not found:
        raise ConvertError(f"--input {folder}: no projector weights (vision_projection.*)")
    return found


def combine_vlm(inputs: list[str], prefixes: list[str], save: str | Path) -> Path:
    """`inputs[i]`'s weights under `prefixes[i]`, as one `torch_dist` checkpoint in `save`."""
    if len(inputs) != len(prefixes):
        raise ConvertError(
            f"--prefixes: {len(prefixes)} given for {len(inputs)} --input checkpoints; one each"
        )
    for prefix in prefixes:
        if prefix not in PREFIXES:
            raise ConvertError(f"--prefixes: {prefix!r} is not one of {', '.join(PREFIXES)}")
    if sorted(set(prefixes)) != sorted(prefixes):
        raise ConvertError(f"--prefixes: each at most once, got {' '.join(prefixes)}")
    for needed in PREFIXES[:2]:
        if needed not in prefixes:
            raise ConvertError(f"--prefixes: a {needed} input is needed")
    states = {p: _read(folder) for p, folder in zip(prefixes, inputs, strict=True)}
    where = dict(zip(prefixes, inputs, strict=True))
    language_dict = states["language_model"]["mg"]["model_config"]
    vision_dict = states["vision_model"]["mg"]["model_config"]
    if "vision_model_type" not in vision_dict:
        raise ConvertError(
            f"--input {where['vision_model']}: not a vision tower (import-hf of a "
            "CLIPVisionModel or SiglipVisionModel writes one)"
        )
    if "vision" in language_dict or "vision_model_type" in language_dict:
        raise ConvertError(f"--input {where['language_model']}: not a language model")
    language = TransformerConfig.from_dict(language_dict)
    vision = VisionConfig.from_dict(vision_dict)
    config = LLaVAConfig(language=language, vision=vision)
    combined: dict[str, Tensor] = {}
    for prefix in ("language_model", "vision_model"):
        combined.update((f"{prefix}.{k}", v) for k, v in states[prefix]["model"].items())
    if "vision_projection" in states:
        projector = _projector(states["vision_projection"], where["vision_projection"])
        _check_projector(projector, config, where["vision_projection"])
        combined.update((f"vision_projection.{k}", v) for k, v in projector.items())
    model_state = megatron_model_state(combined, key_layout(config), extra_state=True)
    tokenizer = states["language_model"]["mg"].get("tokenizer_config")
    common = {
        "args": {"converted_by": "mg-convert combine-vlm", "inputs": dict(where)},
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": ITERATION,
        "mg": mg_metadata(config.to_dict(), tokenizer),
    }
    save_dist_checkpoint(save, ITERATION, {**model_state.tensors, **model_state.objects}, common)
    return Path(save)


def _check_projector(projector: dict[str, Tensor], config: LLaVAConfig, folder: str) -> None:
    """The projector maps the tower's hidden size to the language model's."""
    fc1, fc2 = projector["encoder.linear_fc1.weight"], projector["encoder.linear_fc2.weight"]
    if fc2.shape[0] != config.language.hidden_size:
        raise ConvertError(
            f"--input {folder}: the projector's output size {fc2.shape[0]} "
            f"(vision_projection.encoder.linear_fc2) does not match the language model's "
            f"hidden size {config.language.hidden_size}"
        )
    if fc1.shape[1] != config.vision.hidden_size:
        raise ConvertError(
            f"--input {folder}: the projector's input size {fc1.shape[1]} "
            f"(vision_projection.encoder.linear_fc1) does not match the vision tower's "
            f"hidden size {config.vision.hidden_size}"
        )
