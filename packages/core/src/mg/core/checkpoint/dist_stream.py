"""Write a `torch_dist` checkpoint from one process a part at a time (converters).

`dcp.save` writes one state dict: a converter would have to hold the whole model.
Here each part (a layer's tensors, say: chunks of the layer-stacked keys) is saved
by DCP into a folder of its own, its `.distcp` files are moved beside the others
under names of their own, and its index is merged into the checkpoint's: a key's
chunks from several parts (the layers of a stacked key) become one entry, and each
chunk's storage entry points at the renamed file. `finish` writes the merged
`.metadata`, then common.pt and metadata.json, and renames the folder into place
(`dist_format`'s atomic commit). What DCP reads back is the same as one `dcp.save`
of the whole state would have written.
"""

from __future__ import annotations

import dataclasses
import pickle
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from mg.core.checkpoint.dcp_index import DCP_INDEX_FILENAME
from mg.core.checkpoint.dist_format import (
    PendingSave,
    commit_staged,
    save_planner,
    staging_dirs,
)
from mg.core.checkpoint.global_chunks import dcp_ready, single_process_is_intended
from mg.core.checkpoint.layout import Iteration
from mg.core.checkpoint.serialization import atomic_write


class StreamingDistWriter:
    """`add` parts (top-level DCP keys → tensors, `GlobalChunks`, objects), then `finish`."""

    def __init__(self, save_dir: str | Path, iteration: Iteration) -> None:
        self.save_dir = Path(save_dir)
        self.iteration = iteration
        self.final, self.staging = staging_dirs(self.save_dir, iteration)
        self.save_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.staging, ignore_errors=True)
        self.staging.mkdir()
        self.metadata: Metadata | None = None
        self._parts = 0

    def add(self, state: Mapping[str, Any]) -> None:
        """Save `state` (its keys new to the checkpoint, or new chunks of stacked keys)."""
        part = self.staging / f".part{self._parts}"
        with single_process_is_intended():
            dcp.save(
                dcp_ready(dict(state)), checkpoint_id=part, planner=save_planner(), no_dist=True
            )
        with open(part / DCP_INDEX_FILENAME, "rb") as handle:
            metadata: Metadata = pickle.load(handle)
        renamed = {}
        for file in sorted(part.glob("*.distcp")):
            name = f"__{self._parts}_{file.name.lstrip('_')}"
            file.rename(self.staging / name)
            renamed[file.name] = name
        shutil.rmtree(part)
        storage = {
            index: dataclasses.replace(info, relative_path=renamed[info.relative_path])
            for index, info in metadata.storage_data.items()
        }
        self._merge(dataclasses.replace(metadata, storage_data=storage))
        self._parts += 1

    def _merge(self, part: Metadata) -> None:
        if self.metadata is None:
            self.metadata = part
            return
        merged = self.metadata
        for key, entry in part.state_dict_metadata.items():
            held = merged.state_dict_metadata.get(key)
            if held is None:
                merged.state_dict_metadata[key] = entry
            elif isinstance(held, TensorStorageMetadata) and isinstance(
                entry, TensorStorageMetadata
            ):
                if held.size != entry.size or held.properties.dtype != entry.properties.dtype:
                    raise ValueError(f"{key}: parts disagree on the global shape or dtype")
                held.chunks.extend(entry.chunks)
            else:
                raise ValueError(f"{key}: written by two parts")
        merged.storage_data.update(part.storage_data)
        if isinstance(merged.planner_data, dict) and isinstance(part.planner_data, dict):
            merged.planner_data.update(part.planner_data)

    def finish(self, common: Mapping[str, Any] | None) -> PendingSave:
        """Write the merged index, then commit (common.pt, metadata.json, rename, pointer)."""
        if self.metadata is None:
            raise ValueError("nothing was added to the checkpoint")
        atomic_write(
            self.staging / DCP_INDEX_FILENAME, lambda handle: pickle.dump(self.metadata, handle)
        )
        commit_staged(self.save_dir, self.final, self.staging, self.iteration, common)
        return PendingSave(None, self.final)
