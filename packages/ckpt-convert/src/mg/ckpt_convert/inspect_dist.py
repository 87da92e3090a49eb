"""`mg-convert inspect` of a `torch_dist` checkpoint: DCP's index and common.pt, no tensor data.

The DCP ``.metadata`` file lists every tensor's global shape and dtype, so the
summary covers the whole model (a `torch` checkpoint's covers its rank-0 file).
Either key layout (Megatron-Core's stacked keys, mg's earlier ``model.<name>``),
saved by mg or by Megatron-LM: for Megatron-LM's the model config, the TP × PP
it was saved with and its args come from the args Namespace in common.pt.
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from mg.ckpt_convert.errors import ConvertError
from mg.ckpt_convert.megatron_args import megatron_source_state
from mg.core.checkpoint.dist_format import load_common
from mg.core.checkpoint.layout import Iteration
from mg.core.checkpoint.megatron_dist import LEGACY_MODEL_PREFIX, is_megatron_layout
from mg.core.checkpoint.reader_guard import read_dcp_metadata

_PLAIN = (str, int, float, bool, type(None))
# Megatron-LM args shown in the text summary (all plain ones are in --json).
SHOWN_ARGS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "ffn_hidden_size",
    "padded_vocab_size",
    "seq_length",
    "consumed_train_samples",
    "ckpt_format",
    "transformer_impl",
    "use_distributed_optimizer",
    # MoE
    "num_experts",
    "moe_ffn_hidden_size",
    "moe_layer_freq",
    "moe_router_topk",
    "moe_router_score_function",
    "moe_router_load_balancing_type",
    "moe_shared_expert_intermediate_size",
    "moe_grouped_gemm",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
)


def plain_args(args: dict[str, Any]) -> dict[str, Any]:
    """The args that are plain data (and lists of it, such as a --moe-layer-freq pattern)."""
    return {
        k: v
        for k, v in args.items()
        if isinstance(v, _PLAIN) or (isinstance(v, list) and all(isinstance(x, _PLAIN) for x in v))
    }


def _model_tensor(key: str, megatron: bool) -> bool:
    if not megatron:
        return key.startswith(LEGACY_MODEL_PREFIX)
    return not key.startswith(("optimizer.", "rng_state", "rng.")) and "/" not in key


def summarize_torch_dist(folder: Path, iteration: Iteration) -> dict[str, Any]:
    """The same fields as for a `torch` checkpoint, read from .metadata and common.pt."""
    common = load_common(folder, allow_pickle=True)  # Megatron-LM pickles its args
    meta = common.get("mg") or {}
    raw_args = common.get("args")
    args = vars(raw_args) if isinstance(raw_args, argparse.Namespace) else dict(raw_args or {})
    metadata = read_dcp_metadata(folder)
    megatron = is_megatron_layout(metadata)
    tensors = {
        k: v
        for k, v in metadata.state_dict_metadata.items()
        if _model_tensor(k, megatron) and isinstance(v, TensorStorageMetadata)
    }
    dtypes = Counter(str(t.properties.dtype).removeprefix("torch.") for t in tensors.values())
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    model_config = meta.get("model_config")
    if meta:
        parallel = meta.get("parallel") or {}
        tp, pp = parallel.get("tp", 1), parallel.get("pp", 1)
    else:
        parallel = {}
        # a bare dist_checkpointing.save records no args: the shards say how it was split
        tp = args.get("tensor_model_parallel_size") or saved_tensor_parallel(metadata)
        pp = args.get("pipeline_model_parallel_size") or 1
        model_config = _megatron_config(common, folder)
    keys = (
        "Megatron-Core sharded_state_dict (layers stacked)"
        if megatron
        else "mg per-parameter (model.<name>)"
    )
    return {
        "path": str(folder),
        "iteration": iteration,
        "format": "torch_dist",
        "saved_by": "mg" if meta else "Megatron-LM",
        "keys": keys,
        "layout": f"torch_dist (any layout; saved from TP={tp}, PP={pp})",
        "parameters": sum(t.size.numel() for t in tensors.values()),
        "tensors": len(tensors),
        "tensors_of": "whole model",
        "dtype": dict(dtypes),
        "size_on_disk_bytes": sum(p.stat().st_size for p in files),
        "files": [str(p.relative_to(folder)) for p in files],
        "model_config": model_config,
        "tokenizer_config": meta.get("tokenizer_config"),
        "parallel": parallel or {"tp": tp, "pp": pp},
        "args": plain_args(args),
    }


# Tensors Megatron-Core splits over tensor-parallel ranks along dim 0 and never over pipeline
# stages (the vocabulary rows of the first and last stage's embedding and output layer).
_VOCAB_PARALLEL = ("embedding.word_embeddings.weight", "output_layer.weight")


def saved_tensor_parallel(metadata: Any) -> int:
    """The tensor-parallel size a torch_dist checkpoint was saved at, from DCP's index:
    the number of row chunks of the vocabulary-parallel embedding (1 if it has none)."""
    for key, item in metadata.state_dict_metadata.items():
        if key.endswith(_VOCAB_PARALLEL) and isinstance(item, TensorStorageMetadata):
            return max(1, len({chunk.offsets[0] for chunk in item.chunks}))
    return 1


def _megatron_config(common: dict[str, Any], folder: Path) -> dict[str, Any] | None:
    """The model config Megatron-LM's args describe (None if they describe none we read)."""
    try:
        config, _, _, _ = megatron_source_state(common, folder)
    except ConvertError:
        return None
    return config.to_dict()
