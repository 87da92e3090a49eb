"""Write safetensors files one tensor at a time, byte for byte what `save_file` writes.

`safetensors.torch.save_file` needs every tensor of a file in memory at once.
The format does not: a file is an 8-byte little-endian header length, a JSON
header naming each tensor's dtype, shape and byte range, then the data. So
when the names, dtypes and shapes are known beforehand (export-hf gets them by
converting the model on the meta device), the header is written first and
each tensor is written at its offset the moment it exists, in any order.

To stay byte-identical with `save_file` (tested against it), the layout is
safetensors' own: data sorted by dtype (larger alignment first) then name, the
header in that order with ``__metadata__`` first, compact JSON padded with
spaces to a multiple of 8 bytes. The order is asked from safetensors itself (by
saving empty tensors of the same names and dtypes), so it follows the installed
version.
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import BinaryIO

import torch
from safetensors.torch import save as save_to_bytes
from torch import Tensor

_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def _dtype_name(name: str, dtype: torch.dtype) -> str:
    if dtype not in _DTYPES:
        raise ValueError(f"{name}: dtype {dtype} cannot be written to safetensors here")
    return _DTYPES[dtype]


def _read_header(data: bytes) -> dict:
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + length])


def safetensors_order(
    specs: Mapping[str, Tensor], metadata: Mapping[str, str] | None
) -> tuple[list[str], dict[str, str] | None]:
    """The order in which safetensors lays out tensors of these names and dtypes, and the
    metadata as it writes it (its key order)."""
    empty = {name: torch.empty(0, dtype=t.dtype) for name, t in specs.items()}
    meta = None if metadata is None else dict(metadata)
    header = _read_header(save_to_bytes(empty, metadata=meta))
    return [name for name in header if name != "__metadata__"], header.get("__metadata__")


def plan_layout(
    specs: Mapping[str, Tensor], metadata: Mapping[str, str] | None
) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """The header bytes (length prefix included) and each tensor's absolute byte range.

    ``specs`` maps names to tensors that give the shape and dtype (meta tensors will do).
    """
    order, written_metadata = safetensors_order(specs, metadata)
    header: dict[str, object] = {}
    if written_metadata is not None:
        header["__metadata__"] = written_metadata
    offsets: dict[str, tuple[int, int]] = {}
    position = 0
    for name in order:
        spec = specs[name]
        size = spec.numel() * spec.element_size()
        header[name] = {
            "dtype": _dtype_name(name, spec.dtype),
            "shape": list(spec.shape),
            "data_offsets": [position, position + size],
        }
        offsets[name] = (position, position + size)
        position += size
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    start = 8 + len(text)
    absolute = {name: (start + a, start + b) for name, (a, b) in offsets.items()}
    return struct.pack("<Q", len(text)) + text, absolute


class StreamingSafetensorsFile:
    """One safetensors file: the header at once, then each tensor written as it comes.

    ``write`` checks a tensor against its planned dtype and shape; ``close``
    checks that every planned tensor was written.
    """

    def __init__(
        self, path: str | Path, specs: Mapping[str, Tensor], metadata: Mapping[str, str] | None
    ) -> None:
        if sys.byteorder != "little":
            raise NotImplementedError("safetensors data is little-endian; this machine is not")
        self.path = Path(path)
        self.specs = dict(specs)
        header, self.ranges = plan_layout(self.specs, metadata)
        self.pending = set(self.specs)
        self._file: BinaryIO = open(self.path, "wb")  # noqa: SIM115 (closed by close())
        self._file.write(header)
        end = max((b for _, b in self.ranges.values()), default=len(header))
        self._file.truncate(end)  # the file's final size; data ranges are filled in below

    def write(self, name: str, tensor: Tensor) -> None:
        spec = self.specs.get(name)
        if spec is None or name not in self.pending:
            raise ValueError(f"{self.path.name}: {name!r} is not planned for this file or written")
        if tensor.dtype != spec.dtype or tensor.shape != spec.shape:
            raise ValueError(
                f"{self.path.name}: {name} is {tensor.dtype} {tuple(tensor.shape)}, planned as "
                f"{spec.dtype} {tuple(spec.shape)}"
            )
        start, end = self.ranges[name]
        if end > start:
            data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            self._file.seek(start)
            self._file.write(memoryview(data.numpy()))
        self.pending.discard(name)

    def close(self) -> None:
        self._file.close()
        if self.pending:
            missing = sorted(self.pending)
            raise ValueError(f"{self.path.name}: never written: {missing[:5]}")
