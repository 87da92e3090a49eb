"""Write a `torch.save` file one tensor at a time, so a converter never holds the model.

`torch.save` pickles a whole state dict that is in memory. A `torch.save` file is a
zip archive: one record per tensor storage (``data/<key>``) and the pickled object
(``data.pkl``) that refers to them by key. Here each tensor is written as its
record the moment it is converted and then dropped; ``data.pkl`` comes last, with
the tensors pickled exactly as ``torch.save`` pickles them
(``torch._utils._rebuild_tensor_v2`` of a storage reference). ``torch.load`` —
with ``weights_only=True`` and ``mmap=True`` too — reads the file like any other:
records are found by name, not by position.
"""

from __future__ import annotations

import collections
import io
import pickle
import sys
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

_STORAGE_TYPES = torch.storage._dtype_to_storage_type_map()


class _StorageRef:
    """What the pickle stores for a storage: ("storage", type, key, location, numel)."""

    def __init__(self, key: str, dtype: torch.dtype, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel


class WrittenTensor:
    """A tensor that is already in the archive; pickles as torch.save pickles a tensor."""

    def __init__(self, key: str, dtype: torch.dtype, shape: torch.Size) -> None:
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.ref = _StorageRef(key, dtype, self.shape.numel())

    def __reduce_ex__(self, protocol: int) -> tuple:
        stride, step = [], 1
        for size in reversed(self.shape):
            stride.insert(0, step)
            step *= size
        args = (self.ref, 0, tuple(self.shape), tuple(stride), False, collections.OrderedDict())
        return torch._utils._rebuild_tensor_v2, args


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> tuple | None:
        if isinstance(obj, _StorageRef):
            storage_type = getattr(torch, _STORAGE_TYPES[obj.dtype])
            return ("storage", storage_type, obj.key, "cpu", obj.numel)
        return None


class StreamingTorchFile:
    """``add`` tensors one by one, then ``finish(state)`` with the returned placeholders."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._writer = torch._C.PyTorchFileWriter(str(self.path))
        self._count = 0

    def add(self, tensor: Tensor) -> WrittenTensor:
        tensor = tensor.detach().to("cpu").contiguous()
        storage = tensor.untyped_storage()
        if tensor.storage_offset() != 0 or storage.nbytes() != tensor.numel() * tensor.itemsize:
            tensor = tensor.clone()  # a view of a larger storage: write only its own bytes
            storage = tensor.untyped_storage()
        key = str(self._count)
        self._count += 1
        self._writer.write_record(f"data/{key}", storage, storage.nbytes())
        return WrittenTensor(key, tensor.dtype, tensor.shape)

    def finish(self, state: Any) -> None:
        """Pickle ``state`` (holding the placeholders ``add`` returned) and close the file."""
        buffer = io.BytesIO()
        _Pickler(buffer, protocol=2).dump(state)
        data = buffer.getvalue()
        self._writer.write_record("data.pkl", data, len(data))
        self._writer.write_record(".format_version", "1", 1)
        alignment = str(torch.serialization._get_storage_alignment())
        self._writer.write_record(".storage_alignment", alignment, len(alignment))
        self._writer.write_record("byteorder", sys.byteorder, len(sys.byteorder))
        self._writer.write_end_of_file()
