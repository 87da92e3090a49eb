"""A `torch_dist` checkpoint's DCP index opens in older torch releases.

torch ≤ 2.13's `TensorProperties.__setstate__` unpacks exactly five fields; the
installed torch pickles six (with `strides`). The stand-in below is that older
`__setstate__`, byte for byte in what it accepts, and an unpickler that hands it
the index's TensorProperties stands in for the older release reading the file: DCP's
own index fails it, ours passes it, and the installed torch reads ours as before.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from mg.core.checkpoint.dist_format import load_full_state, save_dist_checkpoint
from mg.core.checkpoint.global_chunks import single_process_is_intended

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"


class _OlderTensorProperties:
    """torch 2.13's `TensorProperties.__setstate__`: five fields, no more, no fewer."""

    def __setstate__(self, state) -> None:
        (
            self.dtype,
            self.layout,
            self.requires_grad,
            self.memory_format,
            self.pin_memory,
        ) = state


class _OlderTorchUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) == (_METADATA_MODULE, "TensorProperties"):
            return _OlderTensorProperties
        return super().find_class(module, name)


def _read_as_older_torch(folder: Path):
    with open(folder / ".metadata", "rb") as handle:
        return _OlderTorchUnpickler(handle).load()


def test_index_reads_in_older_torch_and_in_this_one(tmp_path: Path) -> None:
    weights = {"model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(4)}}
    plain = tmp_path / "plain"
    with single_process_is_intended():
        dcp.save(weights, checkpoint_id=plain, no_dist=True)
    with pytest.raises(ValueError, match="too many values to unpack"):
        _read_as_older_torch(plain)  # DCP's own index: what older releases could not read

    save_dist_checkpoint(tmp_path / "ckpt", 1, weights, {})
    folder = tmp_path / "ckpt" / "iter_0000001"
    older = _read_as_older_torch(folder)
    stored = older.state_dict_metadata["model.w"].properties
    assert stored.dtype == torch.float32 and not stored.pin_memory
    back = load_full_state(folder)
    assert torch.equal(back["w"], weights["model"]["w"]) and torch.equal(back["b"], torch.ones(4))
