"""Rewrite a one-process `torch_dist` checkpoint into mg's earlier per-parameter layout.

mg-train writes Megatron-Core's layout only; checkpoints in the earlier layout
(`model.<name>` keys, the generators under `rng.tp0_pp0.` and rank 0's in
common.pt) are still read. The tests make one from a fresh save: the same weights,
optimizer state and generators, keyed as mg keyed them before.
"""

from __future__ import annotations

import io
import pickle
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from mg.core.checkpoint.dist_format import load_common, load_full_state, save_dist_checkpoint
from mg.core.checkpoint.global_chunks import single_process_is_intended
from mg.core.checkpoint.reader_guard import read_dcp_metadata

_RNG = "rng_state/shard_0.0_1.1"  # one process's Megatron rng_state object


def rewrite_as_earlier_layout(save_dir: Path, iteration: int) -> None:
    """`save_dir`'s iteration folder, saved by one process in Megatron's layout, in the
    earlier layout in its place."""
    folder = save_dir / f"iter_{iteration:07d}"
    metadata = read_dcp_metadata(folder).state_dict_metadata
    rest = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        if isinstance(meta, TensorStorageMetadata)
        else io.BytesIO()
        for key, meta in metadata.items()
        if key.startswith("optimizer.") or key == _RNG
    }
    with single_process_is_intended():
        dcp.load(rest, storage_reader=dcp.FileSystemReader(folder), no_dist=True)
    ((state,),) = rest.pop(_RNG)  # the object holds Megatron's rng_state_list
    tracker = state.pop("rng_tracker_states")
    common = load_common(folder)
    common.pop("content_metadata", None)
    common["rng_state"] = [{**state, "rng_tracker_states": {}}]
    position = {**tracker, "rng_state": pickle.dumps({**state, "rng_tracker_states": {}})}
    sharded = {"model": load_full_state(folder), **rest, "rng": {"tp0_pp0": position}}
    earlier = save_dir.with_name(save_dir.name + ".earlier")
    save_dist_checkpoint(earlier, iteration, sharded, common).wait()
    shutil.rmtree(folder)
    shutil.move(str(earlier / folder.name), str(folder))
    shutil.rmtree(earlier)
