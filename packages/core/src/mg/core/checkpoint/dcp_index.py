"""DCP's index (`.metadata`) written in the form older torch releases read.

torch's DCP pickles each stored tensor's `TensorProperties` through its own
`__getstate__`; recent releases added a sixth field (`strides`), and the
`__setstate__` of releases up to 2.13 unpacks exactly five ("too many values to
unpack (expected 5)"), so a checkpoint written here could not be opened in the
older containers many Megatron-LM users run. Newer releases read the five-field
form (their `__setstate__` takes both), and a load never uses the strides of a plain
tensor, so the index is rewritten with five: torch's own older encoding. A pickler
hook, not an edit of torch's class: only this file's bytes change.
"""

from __future__ import annotations

import copyreg
import io
import pickle
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import TensorProperties

from mg.core.checkpoint.reader_guard import read_dcp_metadata
from mg.core.checkpoint.serialization import atomic_write

DCP_INDEX_FILENAME = ".metadata"
_OLDER_FIELDS = 5  # dtype, layout, requires_grad, memory format, pin_memory


class _OlderTensorPropertiesPickler(pickle.Pickler):
    """Pickles `TensorProperties` with the five-field state older releases unpack."""

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is TensorProperties:
            state = obj.__getstate__()[:_OLDER_FIELDS]
            return copyreg.__newobj__, (TensorProperties,), state
        return NotImplemented


def index_bytes(metadata: Any) -> bytes:
    """DCP's `Metadata` pickled as older torch releases read it."""
    buffer = io.BytesIO()
    _OlderTensorPropertiesPickler(buffer, protocol=pickle.DEFAULT_PROTOCOL).dump(metadata)
    return buffer.getvalue()


def write_portable_index(folder: Path) -> None:
    """Rewrite `folder`'s `.metadata` (a finished DCP save) in the older form, atomically."""
    data = index_bytes(read_dcp_metadata(folder))
    atomic_write(folder / DCP_INDEX_FILENAME, lambda handle: handle.write(data))
