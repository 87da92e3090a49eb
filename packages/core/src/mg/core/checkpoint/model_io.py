"""A model in, a model out: the one place that turns a checkpoint into a `GPTModel`.

Checkpoints are self-describing (``state["mg"]`` holds the model and tokenizer
configs), so eval, serve and the converter rebuild the model from the folder
alone, with no model flags:

    model, config, tokenizer_config, info = load_model("ckpt")
    save_model("out", model, config, tokenizer_config, iteration="release")

The state written by :func:`save_model` is the trainer's: ``model`` (GPTModel
state dict, Megatron-Core names), ``mg`` (:func:`mg_metadata`), ``args`` (a
plain dict), ``iteration``; so ``mg-train --finetune --load`` reads it.

Tokenizer paths recorded relative to the checkpoint folder (what mg-convert
writes: ``tokenizer/``) are resolved against it on load, so a checkpoint folder
can be moved or copied as a whole.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from mg.core.checkpoint.dist_format import (
    is_torch_dist,
    load_common,
    load_full_state,
    stored_keys,
)
from mg.core.checkpoint.ep_merge import (
    merge_expert_parallel,
    rank_files_present,
    whole_expert_sources,
    with_dense_from,
)
from mg.core.checkpoint.layout import RELEASE, CheckpointError, Iteration, scan_rank_dirs
from mg.core.checkpoint.megatron_args import megatron_source_state
from mg.core.checkpoint.pp_split import merge_pipeline
from mg.core.checkpoint.torch_format import (
    find_rank_file,
    iteration_dir,
    load_checkpoint,
    mg_metadata,
    resolve_iteration,
    save_checkpoint_shards,
)
from mg.core.checkpoint.tp_merge import merge_tensor_parallel
from mg.core.models.config import TransformerConfig
from mg.core.models.gpt import GPTModel
from mg.core.models.mamba import decoder_config_from_dict, decoder_model
from mg.core.models.te_spec import te_spec_names, uses_te_spec
from mg.core.quantization.apply import quantize_layout, recorded_quantization
from mg.core.tokenizers.config import TokenizerConfig

_PATH_FIELDS = ("vocab_file", "merge_file", "tokenizer_model")


@dataclass
class ModelInfo:
    """Where a loaded model came from, besides its configs."""

    load_dir: Path
    iteration: Iteration
    path: Path
    """The rank file that was read."""
    args: Any = None
    extra: dict[str, Any] = field(default_factory=dict)
    """Other top-level entries of the state (not ``model``/``optimizer``)."""


def resolve_tokenizer_paths(config: TokenizerConfig, root: str | Path) -> TokenizerConfig:
    """Relative paths that exist under ``root`` become absolute; others stay as given."""
    root = Path(root)
    for name in _PATH_FIELDS:
        value = getattr(config, name)
        if value and not Path(value).is_absolute() and (root / value).exists():
            setattr(config, name, str((root / value).resolve()))
    return config


def load_model(
    load_dir: str | Path,
    iteration: Iteration | None = None,
    map_location: Any = "cpu",
) -> tuple[GPTModel, TransformerConfig, TokenizerConfig | None, ModelInfo]:
    """Build a `GPTModel` from a checkpoint's own metadata and load its weights (strict).

    Reads `torch_dist` checkpoints of any layout and `torch` ones with
    tensor-parallel and pipeline shards (`mp_rank_TT[_PPP]`, stages merged with
    `merge_pipeline`, TP shards along Megatron's partition dims). The model is
    built on the meta device and the loaded tensors are assigned, so weights are
    held once. The model is returned in eval mode (dropout off), as eval and
    serve need it.
    """
    load_dir = Path(load_dir)
    iteration = resolve_iteration(load_dir, iteration)
    folder = iteration_dir(load_dir, iteration)
    if is_torch_dist(folder):
        state, path = described_common(folder), folder
        weights_of = lambda config: load_full_state(  # noqa: E731 (read after the config check)
            folder, grouped=bool(getattr(config, "moe_grouped_gemm", False))
        )
    else:
        state, path, weights_of = _load_torch_format(load_dir, folder, iteration, map_location)
    config, tokenizer_config = model_configs(state, path, load_dir)
    # TE's `_extra_state` (FP8 scaling state, no weights) is for TE's modules only
    weights = {k: v for k, v in weights_of(config).items() if not k.endswith("_extra_state")}
    if uses_te_spec(config):  # Megatron's layout reads back under the local spec's names
        weights = te_spec_names(weights, config)
    with torch.device("meta"):  # a GPTModel, or a MambaModel for a recorded MambaConfig
        model = decoder_model(config)
    quantization = recorded_quantization(state)
    if quantization is not None:  # mg-quantize's output: its linears are quantized modules
        quantize_layout(model, quantization)
    try:
        model.load_state_dict(weights, strict=True, assign=True)
    except RuntimeError as exc:
        raise CheckpointError(
            f"{path}: weights do not fit the recorded model config: {exc}"
        ) from None
    for module in model.modules():  # buffers no checkpoint holds (routers' token counts)
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.is_meta:
                module.register_buffer(name, torch.zeros_like(buffer, device="cpu"), False)
    extra = {k: v for k, v in state.items() if k not in ("model", "optimizer", "args")}
    info = ModelInfo(load_dir, iteration, path, state.get("args"), extra)
    return model.eval(), config, tokenizer_config, info


def described_common(folder: Path) -> dict[str, Any]:
    """A torch_dist folder's common.pt with ``mg``'s record of the model: mg's own, or for
    a save by Megatron-LM the one its args describe (as import-megatron reads them), its
    layers named by the Transformer Engine spec when the stored keys are (Megatron-LM's
    default)."""
    common = load_common(folder)
    if (common.get("mg") or {}).get("model_config") or common.get("args") is None:
        return common
    _, described, _, _ = megatron_source_state(common, folder)
    if stored_keys(folder, "decoder.layers.") & _TE_FUSED_KEYS:
        described["mg"]["model_config"]["transformer_impl"] = "transformer_engine"
    return {**common, "mg": described["mg"]}


# a TE-spec layer's fused norm (Megatron-Core's stacked keys)
_TE_FUSED_KEYS = {
    "decoder.layers.self_attention.linear_qkv.layer_norm_weight",
    "decoder.layers.mlp.linear_fc1.layer_norm_weight",
}


def model_configs(
    state: Mapping[str, Any], path: Path, load_dir: Path
) -> tuple[TransformerConfig, TokenizerConfig | None]:
    """The model and tokenizer configs a checkpoint records (``state["mg"]``)."""
    meta = state.get("mg") or {}
    if not meta.get("model_config"):
        raise CheckpointError(
            f"{path} records no model config (state['mg']['model_config']); it was not written "
            "by mg tools. For a Megatron-LM checkpoint run `mg-convert import-megatron` first."
        )
    config = decoder_config_from_dict(dict(meta["model_config"]))
    tokenizer_config = None
    if meta.get("tokenizer_config"):
        tokenizer_config = resolve_tokenizer_paths(
            TokenizerConfig.from_dict(dict(meta["tokenizer_config"])), load_dir
        )
    return config, tokenizer_config


def _load_torch_format(
    load_dir: Path, folder: Path, iteration: Iteration, map_location: Any
) -> tuple[dict[str, Any], Path, Callable[[TransformerConfig], dict[str, Tensor]]]:
    """Rank 0's state, its path, and a reader of the whole weights (pipeline stages and
    TP shards merged)."""
    path, layout = find_rank_file(folder)
    first = load_checkpoint(
        load_dir, iteration, pp_size=layout.pp, map_location=map_location, ep_rank=0
    )[0]
    etp = _expert_tensor_parallel(first, layout.tp)
    if etp not in (1, layout.tp):
        raise CheckpointError(
            f"{folder} was saved with {layout} and --expert-tensor-parallel-size {etp}; its "
            "experts are read whole (1) or split as TP; save with --ckpt-format torch_dist"
        )
    whole_experts = etp == 1 and layout.tp > 1
    present = rank_files_present([d.numbers for d in scan_rank_dirs(folder)], layout.pp, layout.ep)
    try:
        dense_ep, experts_tp = whole_expert_sources(present, layout.tp, layout.pp, layout.ep)
    except KeyError as missing:
        raise CheckpointError(f"{folder}: {missing.args[0]} (an incomplete copy?)") from None
    cache: dict[tuple[int, int, int], dict[str, Any]] = {(0, 0, 0): first}

    def state(tp: int, pp: int, ep: int) -> dict[str, Any]:
        if (tp, pp, ep) not in cache:
            cache[(tp, pp, ep)] = load_checkpoint(
                load_dir,
                iteration,
                tp_rank=tp,
                pp_rank=pp,
                pp_size=layout.pp,
                ep_rank=ep,
                map_location=map_location,
            )[0]
        return cache[(tp, pp, ep)]

    def chunks(tp: int, pp: int, config: TransformerConfig) -> list[dict[str, Tensor]]:
        """A (tp, pp) position's model chunks, the expert-parallel ranks' experts merged
        (with whole experts, from whichever TP rank's file holds each EP rank's)."""
        holder = (lambda e: experts_tp[(e, pp)]) if whole_experts else (lambda e: tp)
        per_ep = [model_chunks(state(holder(e), pp, e), path) for e in range(layout.ep)]
        merged = (
            per_ep[0]
            if layout.ep == 1
            else [
                merge_expert_parallel(p, config.num_moe_experts) for p in zip(*per_ep, strict=True)
            ]
        )
        if not whole_experts:
            return merged
        dense = model_chunks(state(tp, pp, dense_ep[(tp, pp)]), path)
        return [with_dense_from(m, d) for m, d in zip(merged, dense, strict=True)]

    def weights(config: TransformerConfig) -> dict[str, Tensor]:
        tied = not config.untie_embeddings_and_output_weights
        shards = [
            merge_pipeline(
                [chunks(tp, pp, config) for pp in range(layout.pp)], config.num_layers, tied=tied
            )
            for tp in range(layout.tp)
        ]
        return merge_tensor_parallel(shards, config.gated_linear_unit, config, whole_experts)

    return first, path, weights


def _expert_tensor_parallel(state: Mapping[str, Any], tp: int) -> int:
    """The saved --expert-tensor-parallel-size: mg's record, else Megatron's args, else
    TP (Megatron's default)."""
    parallel = (state.get("mg") or {}).get("parallel") or {}
    if parallel.get("etp"):
        return int(parallel["etp"])
    args = state.get("args")
    args = vars(args) if hasattr(args, "__dict__") else (args or {})
    etp = args.get("expert_tensor_parallel_size") if isinstance(args, Mapping) else None
    return int(etp) if etp else tp


def model_chunks(state: Mapping[str, Any], path: Path) -> list[dict[str, Tensor]]:
    """A rank file's model chunks: `model`, or `model0`, `model1`… (virtual stages)."""
    if "model" in state:
        chunks = [state["model"]]
    else:
        chunks = []
        while f"model{len(chunks)}" in state:
            chunks.append(state[f"model{len(chunks)}"])
    if not chunks:
        raise CheckpointError(f"{path} holds no 'model' (or 'model0') entry")
    return [{k: v for k, v in c.items() if not k.endswith("_extra_state")} for c in chunks]


def save_model(
    save_dir: str | Path,
    model: nn.Module | Mapping[str, Tensor],
    config: TransformerConfig,
    tokenizer_config: TokenizerConfig | None,
    iteration: Iteration = RELEASE,
    args: Mapping[str, Any] | None = None,
) -> Path:
    """Save a model-only checkpoint (no optimizer) atomically; returns the iteration folder.

    ``model`` is a module or its state dict (a converter passes a state dict it
    assembled, so the weights are never held twice). ``iteration`` is an int > 0
    or ``"release"`` (Megatron's name for converted weights; loads as iteration 0).
    """
    weights = model.state_dict() if isinstance(model, nn.Module) else dict(model)
    state = {
        "model": weights,
        "args": dict(args or {}),
        "iteration": iteration if isinstance(iteration, int) else 0,
        "mg": mg_metadata(
            config.to_dict(), tokenizer_config.to_dict() if tokenizer_config else None
        ),
    }
    return save_checkpoint_shards(save_dir, iteration, {(0, 0): state})
