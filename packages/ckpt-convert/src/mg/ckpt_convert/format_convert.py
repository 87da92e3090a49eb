"""`mg-convert format --to torch|torch_dist`: one checkpoint format to the other.

`torch` → `torch_dist`: the whole tensors (TP shards joined, pipeline stages'
local layer numbers mapped to the whole model's) are saved by name through
torch.distributed.checkpoint, so the result loads into any TP/PP/DP layout;
the other entries go to common.pt. `torch_dist` → `torch`: the tensors are
split into the target layout (default: the sizes the source records) exactly
as `reshard` writes them. Both keep the iteration, args (with the recorded
sizes), model and tokenizer configs; optimizer and RNG state are dropped with a
printed note, as in `reshard`.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from mg.ckpt_convert.checkpoint_source import (
    CheckpointSource,
    copy_tokenizer_files,
    open_checkpoint,
)
from mg.ckpt_convert.layout_plan import TargetLayout, plan_target, target_state, target_tensors
from mg.ckpt_convert.reshard import write_torch
from mg.ckpt_convert.staging import check_target, staged_dir
from mg.core.checkpoint.dist_format import save_dist_checkpoint
from mg.core.checkpoint.layout import Iteration

FORMATS = ("torch", "torch_dist")


def write_torch_dist(
    save_dir: Path, source: CheckpointSource, target: TargetLayout, iteration: Iteration
) -> Path:
    """Write ``source`` as a `torch_dist` checkpoint (one process); the iteration folder."""
    weights = target_tensors(source, target, source.names)
    pending = save_dist_checkpoint(
        save_dir, iteration, {"model": weights}, target_state(source, target)
    )
    copy_tokenizer_files(source, save_dir)
    return pending.wait()


def convert_format(
    load: str | Path,
    save: str | Path,
    to: str,
    tp: int | None = None,
    pp: int | None = None,
    iteration: Iteration | None = None,
    divisible_by: int | None = None,
    report: Any = print,
) -> Path:
    """``load`` (either format, any layout) → ``save`` in format ``to``."""
    if to not in FORMATS:
        raise ValueError(f"--to must be one of {FORMATS}, got {to!r}")
    check_target(save)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        source = open_checkpoint(load, iteration)
    target = plan_target(source, tp, pp, divisible_by)
    write = write_torch if to == "torch" else write_torch_dist
    with staged_dir(save) as staging, warnings.catch_warnings():
        # one process on purpose: DCP's "assuming ... a single process" is no news here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        write(staging, source, target, source.iteration)
    layout = f"TP={target.tp}, PP={target.pp}"
    report(
        f"converted iteration {source.iteration}: {source.format} (TP={source.tp}, "
        f"PP={source.pp}) → {to} ({layout if to == 'torch' else 'any layout; records ' + layout})"
    )
    for note in target.notes:
        report(f"note: {note}")
    return Path(save)
