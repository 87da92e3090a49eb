"""A vision-language checkpoint (`mg-train vlm`, or `mg-convert import-hf` of a LLaVA)
→ the model, its tokenizer, its image preprocessing and its prompt format.

The checkpoint records its `LLaVAConfig` (state["mg"]["model_config"] with "vision" and
"language"), so no model flag is needed. Images are preprocessed with the transform the
training data used (`ImageTransform.for_vision_model` of the recorded tower at its
--img-h × --img-w), and prompts are rendered in the run's --tokenizer-prompt-format
(recorded in its args; `raw` when none is).

Both checkpoint formats load whole on one process: a torch checkpoint of one shard, or
a torch_dist one of any layout (Megatron-Core's keys, read into the whole model).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mg.core.checkpoint import CheckpointError, find_rank_file, load_checkpoint
from mg.core.checkpoint.dist_format import is_torch_dist, load_common, load_model_tensors
from mg.core.checkpoint.torch_format import iteration_dir, resolve_iteration
from mg.core.models.vision import LLaVAConfig, LLaVAModel
from mg.core.models.vision.image_processing import ImageTransform
from mg.core.models.vocab_mask import set_real_vocab_size, unpadded_vocab_size
from mg.core.tokenizers import TokenizerConfig
from mg.core.tokenizers.base import BaseTokenizer
from mg.evaluate.errors import EvalInputError
from mg.evaluate.model_loading import eval_tokenizer

PROMPT_FORMATS = ("raw", "chatml", "mistral")


@dataclass
class LoadedVLM:
    model: LLaVAModel
    config: LLaVAConfig
    tokenizer: BaseTokenizer
    transform: ImageTransform
    prompt_format: str
    iteration: Any

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


def _recorded_prompt_format(args: Any) -> str | None:
    if isinstance(args, dict):
        return args.get("tokenizer_prompt_format")
    return getattr(args, "tokenizer_prompt_format", None)


def load_vlm_for_eval(
    load_dir: str | Path,
    iteration: int | str | None = None,
    tokenizer_overrides: dict[str, Any] | None = None,
    prompt_format: str | None = None,
) -> LoadedVLM:
    """The checkpoint's LLaVAModel in eval mode (fp32, CPU or the first GPU) with what
    its training data went through."""
    load_dir = Path(load_dir)
    if not load_dir.is_dir():
        raise EvalInputError("no such checkpoint folder (--load)", load_dir)
    iteration = resolve_iteration(load_dir, iteration)
    folder = iteration_dir(load_dir, iteration)
    if is_torch_dist(folder):
        state, path = load_common(folder), folder
    else:
        path, layout = find_rank_file(folder)
        if layout.tp * layout.pp * layout.ep != 1:
            raise CheckpointError(
                f"{load_dir} was saved with {layout} in the torch format; captioning and vqa "
                "read one shard or a torch_dist checkpoint (--ckpt-format torch_dist)"
            )
        state, iteration = load_checkpoint(load_dir, iteration)
    meta = state.get("mg") or {}
    recorded = meta.get("model_config") or {}
    if "vision" not in recorded or "language" not in recorded:
        raise EvalInputError(
            "not a vision-language checkpoint (no vision tower in its model config); "
            "captioning and vqa evaluate an mg-train vlm or an imported LLaVA model",
            path,
        )
    config = LLaVAConfig.from_dict(dict(recorded))
    model = LLaVAModel(config)
    try:
        if is_torch_dist(folder):  # Megatron-Core's keys (each tower's layers stacked)
            named = model.state_dict()  # the parameters' own tensors: filled in place
            load_model_tensors(folder, named, config)
        else:
            weights = {k: v for k, v in state["model"].items() if not k.endswith("_extra_state")}
            model.load_state_dict(weights, strict=True)
    except (RuntimeError, KeyError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"{path}: weights do not fit the recorded model config: {first}"
        ) from None
    tok_config = None
    if meta.get("tokenizer_config"):
        tok_config = TokenizerConfig.from_dict(dict(meta["tokenizer_config"]))
    tokenizer = eval_tokenizer(
        tok_config, tokenizer_overrides, load_dir, config.language.vocab_size
    )
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = model.to(device=device, dtype=torch.float32).eval()
    set_real_vocab_size(model, unpadded_vocab_size(config.language, tokenizer.vocab_size))
    fmt = prompt_format or _recorded_prompt_format(state.get("args")) or "raw"
    if fmt not in PROMPT_FORMATS:
        raise EvalInputError(
            f"--tokenizer-prompt-format {fmt}: not one of {', '.join(PROMPT_FORMATS)}"
        )
    v = config.vision
    transform = ImageTransform.for_vision_model(v.vision_model_type, v.img_h, v.img_w)
    return LoadedVLM(model, config, tokenizer, transform, fmt, iteration)
