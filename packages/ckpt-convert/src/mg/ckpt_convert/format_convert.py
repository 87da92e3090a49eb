"""`mg-convert format --to torch|torch_dist`: one checkpoint format to the other.

`torch` → `torch_dist`: the whole tensors (TP shards joined, pipeline stages'
local layer numbers mapped to the whole model's) are saved through
torch.distributed.checkpoint in Megatron-Core's layout (a GPT's; others by name),
one layer at a time, so the result loads into any TP/PP/DP layout, in mg and in
Megatron-LM; the other entries go to common.pt. `torch_dist` → `torch`: the tensors are
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
from mg.ckpt_convert.export_hf import group_megatron
from mg.ckpt_convert.layout_plan import TargetLayout, plan_target, target_state, target_tensors
from mg.ckpt_convert.reshard import write_torch
from mg.ckpt_convert.staging import check_target, staged_dir
from mg.core.checkpoint.dist_stream import StreamingDistWriter
from mg.core.checkpoint.formats import dist_layout
from mg.core.checkpoint.layout import Iteration
from mg.core.checkpoint.megatron_dist import megatron_model_state
from mg.core.checkpoint.megatron_sharded_keys import key_layout
from mg.core.models.mamba import MambaConfig

FORMATS = ("torch", "torch_dist")


def _family(source: CheckpointSource) -> str:
    """The model family the checkpoint records (mg-train writes `model_family` into its
    args), else the kind its config is: a hybrid Mamba or a GPT (Megatron-LM's own)."""
    recorded = source.args.get("model_family")
    if recorded:
        return str(recorded)
    return "mamba" if isinstance(source.config, MambaConfig) else "gpt"


def write_torch_dist(
    save_dir: Path,
    source: CheckpointSource,
    target: TargetLayout,
    iteration: Iteration,
    common: dict[str, Any] | None = None,
) -> Path:
    """Write ``source`` as a `torch_dist` checkpoint (one process); the iteration folder.

    Every family goes in Megatron-Core's key layout (core's `dist_layout` and
    `key_layout`, from the model's family and configuration), one layer at a time
    (`StreamingDistWriter`: no more than a layer is held). ``common`` (common.pt)
    defaults to the source's entries updated to the target."""
    if common is None:
        common = target_state(source, target)
    config = target.config
    dist_layout(_family(source), config)  # refuses a family without Megatron's layout
    writer = StreamingDistWriter(save_dir, iteration)
    for group in group_megatron(source.names):
        if not group:
            continue
        tensors = target_tensors(source, target, group)
        state = megatron_model_state(tensors, key_layout(config), extra_state=True)
        writer.add({**state.tensors, **state.objects})
        source.release()  # what this layer read leaves memory with it
    pending = writer.finish({**common, "content_metadata": {"singleton_local_shards": False}})
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
