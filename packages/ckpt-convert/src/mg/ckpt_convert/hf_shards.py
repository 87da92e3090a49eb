"""A Hugging Face model's safetensors shards, planned up front and filled tensor by tensor.

The rule for cutting the model into shards is the one export-hf always used
(and `save_pretrained`'s): tensors in conversion order; a shard is closed
when the next tensor would take it past ``max_bytes`` (a tensor larger than
that gets a shard of its own). One shard is ``model.safetensors``; several are
``model-0000K-of-0000N.safetensors`` with ``model.safetensors.index.json``.
Because the plan is made from shapes alone, every file's header is written
first and each tensor goes straight to its place in the file when converted
(:mod:`.safetensors_stream`), so no shard is ever held in memory.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from torch import Tensor

from mg.ckpt_convert.hf_source import SAFETENSORS_INDEX
from mg.ckpt_convert.safetensors_stream import StreamingSafetensorsFile

METADATA = {"format": "pt"}  # what save_pretrained writes


def nbytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def plan_shards(specs: Sequence[tuple[str, Tensor]], max_bytes: int) -> list[dict[str, Tensor]]:
    """Cut ``(name, tensor-or-meta)`` pairs, in order, into shards of at most ``max_bytes``."""
    shards: list[dict[str, Tensor]] = []
    current: dict[str, Tensor] = {}
    size = 0
    for name, spec in specs:
        if current and size + nbytes(spec) > max_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = spec
        size += nbytes(spec)
    if current:
        shards.append(current)
    return shards


def shard_filenames(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]


class ShardedWriter:
    """Writes planned shards in order; ``add`` each tensor of the plan in the plan's order."""

    def __init__(self, folder: Path, shards: list[dict[str, Tensor]]) -> None:
        self.folder, self.shards = folder, shards
        self.filenames = shard_filenames(len(shards))
        self._index = -1
        self._file: StreamingSafetensorsFile | None = None

    def add(self, name: str, tensor: Tensor) -> None:
        while self._file is None or name not in self._file.specs:
            self._next_file()
        self._file.write(name, tensor)

    def _next_file(self) -> None:
        if self._file is not None:
            self._file.close()
        self._index += 1
        if self._index >= len(self.shards):
            raise ValueError("a tensor came that the shard plan does not hold (plan mismatch)")
        path = self.folder / self.filenames[self._index]
        self._file = StreamingSafetensorsFile(path, self.shards[self._index], METADATA)

    def finish(self) -> None:
        """Close the last file (every planned tensor must have come) and write the index."""
        while self._index < len(self.shards) - 1:
            self._next_file()  # raises at close if a planned tensor never came
        if self._file is not None:
            self._file.close()
        if len(self.shards) == 1:
            return
        weight_map = {
            name: filename
            for shard, filename in zip(self.shards, self.filenames, strict=True)
            for name in shard
        }
        total = sum(nbytes(t) for shard in self.shards for t in shard.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (self.folder / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
