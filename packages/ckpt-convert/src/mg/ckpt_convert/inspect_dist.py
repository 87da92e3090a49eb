"""`mg-convert inspect` of a `torch_dist` checkpoint: DCP's index and common.pt, no tensor data.

The DCP ``.metadata`` file lists every tensor's global shape and dtype, so the
summary covers the whole model (a `torch` checkpoint's covers its rank-0 file).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from mg.core.checkpoint.dist_format import load_common
from mg.core.checkpoint.layout import Iteration
from mg.core.checkpoint.reader_guard import read_dcp_metadata


def summarize_torch_dist(folder: Path, iteration: Iteration) -> dict[str, Any]:
    """The same fields as for a `torch` checkpoint, read from .metadata and common.pt."""
    common = load_common(folder)
    meta = common.get("mg") or {}
    parallel = meta.get("parallel") or {}
    index = read_dcp_metadata(folder).state_dict_metadata
    tensors = {
        k: v
        for k, v in index.items()
        if k.startswith("model.") and isinstance(v, TensorStorageMetadata)
    }
    dtypes = Counter(str(t.properties.dtype).removeprefix("torch.") for t in tensors.values())
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    saved = f"TP={parallel.get('tp', 1)}, PP={parallel.get('pp', 1)}"
    return {
        "path": str(folder),
        "iteration": iteration,
        "format": "torch_dist",
        "layout": f"torch_dist (any layout; saved from {saved})",
        "parameters": sum(t.size.numel() for t in tensors.values()),
        "tensors": len(tensors),
        "tensors_of": "whole model",
        "dtype": dict(dtypes),
        "size_on_disk_bytes": sum(p.stat().st_size for p in files),
        "files": [str(p.relative_to(folder)) for p in files],
        "model_config": meta.get("model_config"),
        "tokenizer_config": meta.get("tokenizer_config"),
        "parallel": parallel or None,
    }
