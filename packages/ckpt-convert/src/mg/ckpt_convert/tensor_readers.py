"""Where a checkpoint's tensors come from: read when asked, let go of after.

A converter walks the model one layer (or pipeline stage) at a time; these
readers make sure that what it has read does not stay in memory behind it.

- `TorchFilesReader`, `torch` format: each ``mp_rank_*/model_optim_rng.pt`` is
  memory-mapped on first use. A mapped page that has been read counts in the
  process's resident memory for as long as the mapping is open, so reading a
  whole model through one long-lived mapping ends with the model resident.
  `release()` closes every open file (the converters call it after each step);
  the next read maps the file again, which costs only its small pickle.
- `DistReader`, `torch_dist`: ``read(names)`` asks torch.distributed.checkpoint
  for just those tensors, whole, in one process without a process group, into
  tensors allocated for them; DCP reads their byte ranges from the ``.distcp``
  files and nothing else. In Megatron-Core's layout a layer's tensor is one slice
  of a layer-stacked key, and only that slice is read.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor

from mg.ckpt_convert.errors import ConvertError
from mg.core.checkpoint.megatron_dist import StoredParameter, read_parameters
from mg.core.checkpoint.reader_guard import guard_dcp_load
from mg.core.checkpoint.serialization import load_file

MODEL_PREFIX = "model."  # torch_dist stores the model's tensors under model.<name>


class TensorReader(Protocol):
    """Reads the tensor-parallel shards of whole-model names, in rank order."""

    def read(self, names: Sequence[str]) -> dict[str, list[Tensor]]: ...

    def release(self) -> None: ...


def model_chunks(state: Mapping[str, Any], path: Path) -> list[Mapping[str, Any]]:
    """``model``, or ``model0``, ``model1``… (virtual pipeline stages), in order."""
    if isinstance(state.get("model"), Mapping):
        return [state["model"]]
    virtual = sorted(
        (int(k[5:]), v) for k, v in state.items() if k[5:].isdigit() and k.startswith("model")
    )
    if not virtual:
        raise ConvertError(f"{path} holds no 'model' entry")
    return [v for _, v in virtual]


@dataclass(frozen=True)
class ShardRef:
    """One tensor-parallel shard: which file, which model chunk, its key there."""

    path: Path
    chunk: int
    key: str


class TorchFilesReader:
    """`torch`-format rank files, memory-mapped while in use (see the module doc)."""

    def __init__(self, refs: Mapping[str, list[ShardRef]], allow_pickle: bool = False) -> None:
        self.refs = dict(refs)
        self.allow_pickle = allow_pickle
        self._open: dict[Path, list[Mapping[str, Any]]] = {}

    def _chunks(self, path: Path) -> list[Mapping[str, Any]]:
        if path not in self._open:
            state = load_file(path, mmap=True, allow_pickle=self.allow_pickle)
            self._open[path] = model_chunks(state, path)
        return self._open[path]

    def read(self, names: Sequence[str]) -> dict[str, list[Tensor]]:
        return {
            name: [self._chunks(r.path)[r.chunk][r.key] for r in self.refs[name]] for name in names
        }

    def release(self) -> None:
        self._open.clear()


@contextmanager
def _one_process() -> Iterator[None]:
    """DCP warns on every load without a process group; one process is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r"torch\.distributed is (disabled, )?unavailable or uninitialized"
        )
        yield


class DistReader:
    """A torch_dist checkpoint's model tensors, read by name through DCP (`stored`: where
    each name lives in Megatron-Core's layout; None for mg's earlier `model.<name>`)."""

    def __init__(
        self,
        folder: Path,
        metas: Mapping[str, Tensor],
        stored: Mapping[str, StoredParameter] | None = None,
    ) -> None:
        self.folder = folder
        self.metas = dict(metas)  # name -> meta tensor of the stored (whole) shape and dtype
        self.stored = stored

    def read(self, names: Sequence[str]) -> dict[str, list[Tensor]]:
        if self.stored is not None:
            read = read_parameters(self.folder, self.stored, names)
            return {name: [read[name]] for name in names}
        wanted = {name: torch.empty_like(self.metas[name], device="cpu") for name in names}
        if wanted:
            # DCP flattens nested dicts with dots: {"model": {name: t}} is model.<name>.
            with _one_process(), guard_dcp_load(self.folder):
                dcp.load(
                    {MODEL_PREFIX[:-1]: wanted},
                    storage_reader=dcp.FileSystemReader(self.folder),
                    no_dist=True,
                )
        return {name: [tensor] for name, tensor in wanted.items()}

    def release(self) -> None:
        """Nothing to close: each read's tensors belong to the caller."""
