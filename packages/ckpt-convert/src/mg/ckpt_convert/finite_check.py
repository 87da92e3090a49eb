"""After `import-hf`: warn when the imported weights hold NaN or Inf.

The conversion is exact, so such values come from the source (a broken save, a
cast to a dtype too narrow for the weights); a model with them produces NaN as
soon as it is trained or served. The check reads the written checkpoint back
memory-mapped, one tensor at a time, so it costs a read, not a second copy.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from mg.core.checkpoint import RELEASE, checkpoint_file
from mg.core.checkpoint.serialization import load_file


def nonfinite_counts(state: dict[str, torch.Tensor]) -> dict[str, int]:
    """Parameter name -> how many of its values are NaN or ±Inf (only those with any)."""
    counts = {}
    for name, tensor in state.items():
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
            bad = tensor.numel() - int(torch.isfinite(tensor).sum())
            if bad:
                counts[name] = bad
    return counts


def warn_if_nonfinite(save: str | Path, source: str) -> dict[str, int]:
    """Print one warning line naming the tensors with NaN/Inf; returns the counts."""
    state = load_file(checkpoint_file(save, RELEASE), mmap=True)
    counts = nonfinite_counts(state.get("model") or {})
    if counts:
        shown = ", ".join(f"{name} ({n:,} values)" for name, n in list(counts.items())[:5])
        more = f" and {len(counts) - 5} more" if len(counts) > 5 else ""
        print(
            f"mg-convert import-hf: warning: {source}: {len(counts)} weight tensor(s) hold NaN "
            f"or Inf: {shown}{more}. The model will produce NaN; check the source files.",
            file=sys.stderr,
            flush=True,
        )
    return counts
