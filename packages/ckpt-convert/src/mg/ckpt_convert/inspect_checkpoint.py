"""`mg-convert inspect`: what a checkpoint holds, without loading it into memory."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path
from typing import Any

from mg.ckpt_convert.architectures import hf_class_name
from mg.ckpt_convert.errors import ConvertError
from mg.ckpt_convert.inspect_dist import SHOWN_ARGS, plain_args, summarize_torch_dist
from mg.ckpt_convert.megatron_args import config_from_megatron_args
from mg.core.checkpoint import describe, load_checkpoint
from mg.core.checkpoint.dist_format import is_torch_dist
from mg.core.checkpoint.torch_format import iteration_dir, resolve_iteration


def summarize(load: str | Path, iteration: int | str | None = None) -> dict[str, Any]:
    """Config, iteration, layout, parameter count, dtypes and size on disk (rank-0 file)."""
    iteration = resolve_iteration(load, iteration)
    folder = iteration_dir(load, iteration)
    if is_torch_dist(folder):
        return summarize_torch_dist(folder, iteration)
    info = describe(load, iteration, allow_pickle=False)
    state, _ = load_checkpoint(load, info.iteration, mmap=True)
    model = state.get("model") or {}
    tensors = {k: v for k, v in model.items() if hasattr(v, "numel")}
    dtypes = Counter(str(t.dtype).removeprefix("torch.") for t in tensors.values())
    megatron = {}
    if not state.get("mg") and state.get("args") is not None:  # Megatron-LM's own
        megatron = _megatron_summary(state, info.path)
    return {
        "path": str(info.path),
        "iteration": info.iteration,
        "layout": str(info.layout),
        "parameters": sum(t.numel() for t in tensors.values() if not t.dtype.is_complex),
        "tensors": len(tensors),
        "dtype": dict(dtypes),
        "size_on_disk_bytes": info.total_bytes,
        "files": [str(p.relative_to(info.path)) for p in info.files],
        "model_config": info.model_config,
        "tokenizer_config": info.tokenizer_config,
        "parallel": info.parallel,
        **megatron,
    }


def _megatron_summary(state: dict[str, Any], folder: Path) -> dict[str, Any]:
    """A Megatron-LM `torch` checkpoint: its args, and the model config they describe."""
    raw = state["args"]
    args = vars(raw) if isinstance(raw, argparse.Namespace) else dict(raw)
    try:
        config = config_from_megatron_args(args).to_dict()
    except ConvertError:
        config = None
    return {
        "saved_by": "Megatron-LM",
        "model_config": config,
        "parallel": {
            "tp": args.get("tensor_model_parallel_size") or 1,
            "pp": args.get("pipeline_model_parallel_size") or 1,
            "ep": args.get("expert_model_parallel_size") or 1,
        },
        "args": plain_args(args),
    }


# Fields that describe a feature the model may not have: shown only when it has it
# (a dense model's summary listing moe_router_topk = 2 reads as if it were an MoE).
_FEATURE_FIELDS = {("moe_", "num_moe_experts"): "num_moe_experts"}


def _shown(key: str, config: dict[str, Any]) -> bool:
    for prefixes, switch in _FEATURE_FIELDS.items():
        if key.startswith(prefixes) and key != switch:
            return bool(config.get(switch))
    return True


def _hf_class(model_type: str) -> str:
    try:
        return f"{hf_class_name(model_type)} ({model_type})"
    except ValueError:
        return model_type


def format_summary(summary: dict[str, Any]) -> str:
    config = dict(summary["model_config"] or {})
    extra = config.pop("extra", {}) or {}
    lines = [
        f"checkpoint   {summary['path']}",
        f"iteration    {summary['iteration']}",
        f"layout       {summary['layout']}",
        f"parameters   {summary['parameters']:,} in {summary['tensors']} tensors "
        f"({summary.get('tensors_of', 'rank 0')})",
        f"dtype        {', '.join(f'{k} ×{v}' for k, v in summary['dtype'].items())}",
        f"size on disk {summary['size_on_disk_bytes'] / 1e6:.1f} MB "
        f"in {len(summary['files'])} files",
        f"tokenizer    {json.dumps(summary['tokenizer_config'])}",
    ]
    if extra.get("hf_model_type"):  # imported from (or exportable as) this HF class
        lines.insert(3, f"architecture {_hf_class(extra['hf_model_type'])}")
    if "keys" in summary:  # torch_dist
        lines.insert(3, f"saved by     {summary['saved_by']}; keys: {summary['keys']}")
    elif "saved_by" in summary:
        lines.insert(3, f"saved by     {summary['saved_by']}")
    args = summary.get("args") or {}
    if summary.get("saved_by") == "Megatron-LM" and args:
        lines.append("megatron args:")
        lines += [f"  {k} = {args[k]}" for k in SHOWN_ARGS if args.get(k) is not None]
    lines.append("model config:" if config else "model config: (none recorded)")
    lines += [f"  {k} = {v}" for k, v in config.items() if v is not None and _shown(k, config)]
    for key in ("hf_model_type", "hf_vocab_size"):
        if key in extra:
            lines.append(f"  extra.{key} = {extra[key]}")
    return "\n".join(lines)
